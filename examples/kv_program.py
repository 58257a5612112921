"""Exports the example decoder as one ExecuTorch program with `prefill` and `decode` methods that
share runtime-owned KV caches (zerokv allocates, grows and binds them; the delegates of both methods
name the same storage)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import torch
from tqdm import tqdm

import zerokv.executorch as zx
from examples.llama_decoder import Config, LlamaDecoder

# export_step's tokens placeholder: the runtime reads a step's width from its dim 1.
STEP_WIDTH = ("tokens", 1)
# export_step's position placeholder: the runtime fills it with each step's first position.
POSITIONS = "position"


def cache_input_names(config: Config):
    """The placeholders torch.export gives the `*caches` inputs: K then V of each layer."""
    return [f"caches_{index}" for index in range(2 * config.layers)]


def runtime_kv(config: Config, max_capacity: int, initial_capacity: int) -> zx.RuntimeKV:
    names = cache_input_names(config)
    layers = tuple(
        zx.KVCacheLayer(names[2 * layer], names[2 * layer + 1], max_capacity=max_capacity,
                        initial_capacity=initial_capacity)
        for layer in range(config.layers))
    return zx.RuntimeKV(layers=layers, step_width=STEP_WIDTH, positions=POSITIONS)


def export_step(model: LlamaDecoder, steps: int, max_capacity: int):
    """The step over `steps` tokens, with a dynamic cache capacity and caches of the weights' dtype."""
    capacity = torch.export.Dim("capacity", min=2, max=max_capacity)
    caches = tuple(torch.zeros(model.config.cache_shape(max_capacity), dtype=model.embed.dtype)
                   for _ in range(2 * model.config.layers))
    tokens = torch.zeros(1, steps, dtype=torch.long)
    with torch.no_grad():
        return torch.export.export(
            model.eval(), (tokens, torch.tensor(0), *caches),
            dynamic_shapes=(None, None, tuple({2: capacity} for _ in caches)))


@contextlib.contextmanager
def _progress(total: int, description: str):
    """A stderr bar over `total` stages whose elapsed time keeps ticking during a long stage."""
    bar = tqdm(total=total, desc=description, file=sys.stderr, unit="stage",
               bar_format="{desc}: {n}/{total} {bar} {elapsed} {postfix}")
    done = threading.Event()

    def tick():
        while not done.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield bar
    finally:
        done.set()
        ticker.join()
        bar.close()


def export_program(config: Config, *, seed: int, device: str, max_capacity: int, initial_capacity: int,
                   prefill_length: int, cuda_graph: bool = False):
    """Returns the ExecutorchProgramManager. device "cpu" compiles the engines for the CPU (the
    delegates stay tagged cuda:0 and run over a host-memory device allocator); "cuda" for the GPU,
    where cuda_graph has the runtime replay each engine's runs as CUDA graphs."""
    model = LlamaDecoder(config, seed=seed)
    with _progress(4, "export") as bar:
        bar.set_postfix_str("tracing prefill")
        prefill = export_step(model, prefill_length, max_capacity)
        bar.update()
        bar.set_postfix_str("tracing decode")
        decode = export_step(model, 1, max_capacity)
        bar.update()
        bar.set_postfix_str(f"lowering and compiling 2 AOTInductor engines ({device})")
        started = time.monotonic()
        manager = zx.export(
            {"prefill": prefill, "decode": decode},
            engine="aoti",
            device="cuda:0",
            engine_options={"compile_device": device, "cuda_graph": cuda_graph},
            runtime_kv=runtime_kv(config, max_capacity, initial_capacity),
        )
        bar.update()
        bar.set_postfix_str(f"compiled in {time.monotonic() - started:.0f} s")
        bar.update()
    return manager
