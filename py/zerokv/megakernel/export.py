"""A transformers Llama model's decode step for the MEGAKERNEL engine, over runtime-owned caches.

    program, runtime_kv = export_decode(model, max_capacity=32768)
    manager = zerokv.executorch.export({"decode": program}, engine="megakernel", runtime_kv=runtime_kv)

The caches are the runtime's (zerokv.executorch.RuntimeKV): it allocates them, grows them by
doubling up to `max_capacity` and fills cache_position with the committed length, and the kernel
writes each step's rows into them in place. Nothing in the step reads the rows it writes, so only
runtime-owned caches keep the write: caller-owned zero-copy caches refuse it (zero_copy.py).
"""

from __future__ import annotations

import torch

import zerokv.executorch as zx
from zerokv.megakernel.llama_step import LlamaDecodeStep, LlamaStepError


def cache_input_names(layers: int) -> list[str]:
    """The placeholders torch.export gives LlamaDecodeStep's `*caches`: K then V of each layer."""
    return [f"caches_{index}" for index in range(2 * layers)]


DEFAULT_INITIAL_CAPACITY = 256


def export_decode(model, max_capacity: int, initial_capacity: int | None = None):
    """(the decode step's ExportedProgram, its RuntimeKV): one token at a time over caches that
    start at `initial_capacity` positions (by default DEFAULT_INITIAL_CAPACITY, or max_capacity
    when that is less) and grow by doubling to `max_capacity`."""
    if not isinstance(max_capacity, int) or max_capacity < 2:
        raise LlamaStepError(f"max_capacity: {max_capacity!r}; expected at least 2 positions")
    if initial_capacity is None:
        initial_capacity = min(DEFAULT_INITIAL_CAPACITY, max_capacity)
    step = LlamaDecodeStep(model).eval()
    config = model.config
    caches = tuple(torch.zeros(1, config.num_key_value_heads, max_capacity, config.head_dim, dtype=torch.bfloat16,
                               device=model.device) for _ in range(2 * config.num_hidden_layers))
    capacity = torch.export.Dim("capacity", min=2, max=max_capacity)
    with torch.no_grad():
        program = torch.export.export(
            step, (torch.zeros(1, 1, dtype=torch.long, device=model.device),
                   torch.zeros(1, dtype=torch.long, device=model.device), *caches),
            dynamic_shapes={"input_ids": None, "cache_position": None, "caches": tuple({2: capacity} for _ in caches)},
            strict=False)
    names = cache_input_names(config.num_hidden_layers)
    layers = tuple(zx.KVCacheLayer(names[2 * layer], names[2 * layer + 1], max_capacity=max_capacity,
                                   initial_capacity=initial_capacity)
                   for layer in range(config.num_hidden_layers))
    return program, zx.RuntimeKV(layers=layers, step_width=("input_ids", 1), positions="cache_position")
