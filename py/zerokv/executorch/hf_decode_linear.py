"""One-token linear layers for Hugging Face decoders compiled for CUDA.

A decode step's matrix products have one row each and are bound by the memory's bandwidth.
`use_matvec_decode(model)` makes every `torch.nn.Linear` of the model (projections, MLP, output
head) compute a one-row input through zerokv's matrix-vector kernel (`zerokv::matvec`,
zerokv.kernels.matvec, a `torch.library.triton_op` AOTInductor compiles into the engine); inputs
of several rows (prefill) keep torch's linear. The module keeps its parameters and their names, so
the program's weights are what they were.

The kernel is for CUDA (on the CPU only under Triton's interpreter) and the dtypes in
zerokv.kernels.matvec_contract: a model of another dtype, or a machine that cannot run the kernel,
is refused by name when the model is switched; a layer the kernel cannot take (one whose weight's
dtype is not its input's) is refused by name by the kernel, at export or at its first step.
"""

from __future__ import annotations

import torch

from zerokv.errors import ZeroKVError
from zerokv.kernels import matvec_contract as contract


class DecodeLinearError(ZeroKVError, ValueError):
    """The model or machine cannot take the matrix-vector kernel; the message says why."""


class MatvecLinear(torch.nn.Linear):
    """torch.nn.Linear whose one-row inputs go through zerokv::matvec."""

    def forward(self, x):
        if contract.is_one_row(x):
            return torch.ops.zerokv.matvec(x, self.weight, self.bias)
        return super().forward(x)


def use_matvec_decode(model) -> int:
    """Switches `model`'s linear layers to MatvecLinear; returns how many were switched."""
    if model.dtype not in contract.DTYPES:
        raise DecodeLinearError(f"{model.config.model_type}: one-token linear layers: the model is {model.dtype}; "
                                f"the kernel takes {', '.join(map(str, contract.DTYPES))}")
    _load_kernel()
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = MatvecLinear
            switched += 1
    return switched


def _load_kernel():
    try:
        from zerokv.kernels import matvec  # registers torch.ops.zerokv.matvec
    except ImportError as error:
        raise DecodeLinearError(f"one-token linear layers need Triton: {error}") from error
    if not (torch.cuda.is_available() or matvec.INTERPRETED):
        raise DecodeLinearError("one-token linear layers: the kernel is CUDA's; this machine has no CUDA device (on "
                                "the CPU it runs only under Triton's interpreter, TRITON_INTERPRET=1)")
