"""Flash-decoding for Hugging Face decoders compiled for CUDA.

A one-token decode step has one query per head: a masked SDPA over the cache gives it few thread
blocks and reads every position of the capacity. `use_splitk_decode(model)` makes the model's
full-attention layers attend, at one-token steps, through zerokv's split-K decode kernels
(`zerokv::flash_decode`, zerokv.kernels.flash_decode, a `torch.library.triton_op`), which
AOTInductor compiles into the engine like any other kernel. The step's position is read on the
device, so a CUDA graph replays it at any position; the positions past it are never read, over a
static cache (caller-owned) and over a runtime-owned one alike, whose capacity is dynamic: one
engine serves every capacity the cache grows to.

Prefill (several tokens) and sliding-window layers keep transformers' SDPA. The kernels are for
CUDA, bfloat16 or float16, and power-of-two head sizes of 16 or more
(zerokv.kernels.flash_decode_contract); anything else is refused by name when the model is
switched, not at the first step. A decode step attends to every position up to its own, as a causal
mask over one sequence does: the attention mask is not read, so a step of several sequences (which
a batch pads) is refused.
"""

from __future__ import annotations

import torch

from zerokv.errors import ZeroKVError
from zerokv.kernels import flash_decode_contract as contract

SPLITK_DECODE = "zerokv_splitk_decode"


class DecodeAttentionError(ZeroKVError, ValueError):
    """The model or machine cannot take the split-K decode kernel; the message says why."""


def use_splitk_decode(model) -> None:
    """Switches `model` (a transformers decoder, bfloat16 or float16, on CUDA) to split-K decode attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    problems = []
    if model.dtype not in contract.DTYPES:
        problems.append(f"the model is {model.dtype}; the kernels take {' or '.join(map(str, contract.DTYPES))}")
    if problem := contract.head_dim_problem(head_dim):
        problems.append(problem)
    if problems:
        raise DecodeAttentionError(f"{config.model_type}: split-K decode attention: {'; '.join(problems)}")
    _load_kernel()
    AttentionInterface.register(SPLITK_DECODE, splitk_decode_attention)
    # Masks as SDPA takes them, for the steps that keep SDPA.
    AttentionMaskInterface.register(SPLITK_DECODE, sdpa_mask)
    model.set_attn_implementation(SPLITK_DECODE)


def _load_kernel():
    try:
        from zerokv.kernels import flash_decode  # registers torch.ops.zerokv.flash_decode
    except ImportError as error:
        raise DecodeAttentionError(f"split-K decode attention needs Triton: {error}") from error
    if not (torch.cuda.is_available() or flash_decode.INTERPRETED):
        raise DecodeAttentionError("split-K decode attention: the kernels are CUDA's; this machine has no CUDA "
                                   "device (on the CPU they run only under Triton's interpreter, TRITON_INTERPRET=1)")


def splitk_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            position_ids=None, **kwargs):
    """transformers' attention interface: query [B, H, T, D], key/value [B, H_kv, capacity, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or getattr(module, "sliding_window", None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_ids=position_ids, **kwargs)
    if position_ids is None:
        raise DecodeAttentionError(f"{type(module).__name__}: split-K decode attention needs the step's "
                                   "position_ids (the committed length comes from them)")
    if query.shape[0] != 1:
        # The kernels attend to every position up to the step's, as a causal mask over one sequence
        # does; a batch's padding mask would be dropped, silently.
        raise DecodeAttentionError(f"{type(module).__name__}: split-K decode attention takes one sequence, not "
                                   f"{query.shape[0]}: the attention mask, which pads a batch, is not read")
    out = torch.ops.zerokv.flash_decode(query, key, value, position_ids[0, -1:], scaling or query.shape[-1] ** -0.5)
    return out, None
