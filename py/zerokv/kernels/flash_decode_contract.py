"""What zerokv::flash_decode takes, without importing Triton: a model is checked against it when it
is switched to the kernels (zerokv.executorch.hf_decode_attention), on machines that may lack Triton."""

from __future__ import annotations

import torch

from zerokv.errors import ZeroKVError

DTYPES = (torch.bfloat16, torch.float16)
# tl.dot's smallest operand side: a head is one side of both products (and a KV head's group of
# query heads is padded to it).
MIN_DOT_SIZE = 16


class FlashDecodeError(ZeroKVError, ValueError):
    """zerokv::flash_decode cannot take these inputs; the message names the one at fault."""


def head_dim_problem(head_dim: int) -> str | None:
    """Why the kernels cannot take heads of `head_dim`, or None."""
    if head_dim < MIN_DOT_SIZE or head_dim & (head_dim - 1):
        return f"head size {head_dim} is not a power of two of {MIN_DOT_SIZE} or more"
    return None
