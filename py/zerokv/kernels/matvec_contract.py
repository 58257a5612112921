"""What zerokv::matvec takes, without importing Triton: a model is checked against it when its linear
layers are switched to the kernel (zerokv.executorch.hf_decode_linear), on machines that may lack Triton."""

from __future__ import annotations

import torch

from zerokv.errors import ZeroKVError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Products one zerokv::matvec_siblings launch computes: a decoder's query, key and value.
MAX_SIBLINGS = 3


class MatvecError(ZeroKVError, ValueError):
    """zerokv::matvec cannot take these inputs; the message names the one at fault."""


def is_one_row(x) -> bool:
    """Whether `x` ([..., K]) holds one row: one token's input, what the kernel takes. Static in an
    export (a decode program has one token; a prefill program's dynamic count is at least two)."""
    return x.dim() > 0 and x.numel() == x.shape[-1]
