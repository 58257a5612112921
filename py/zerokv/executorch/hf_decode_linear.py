"""One-token linear layers for Hugging Face decoders compiled for CUDA.

A decode step's matrix products have one row each and are bound by the memory's bandwidth.
`use_matvec_decode(model)` makes every `torch.nn.Linear` of the model (projections, MLP, output
head) compute a one-row input through zerokv's matrix-vector kernel (`zerokv::matvec`,
zerokv.kernels.matvec, a `torch.library.triton_op` AOTInductor compiles into the engine); inputs
of several rows (prefill) keep torch's linear. A gated SiLU MLP (`down(SiLU(gate(x)) * up(x))`, its
forward the same code as Llama's) computes gate, up and the activation in one pass over both weights
(`zerokv::gated_matvec`), so a decode step's MLP is two kernels, not four. The attention's query,
key and value, three calls on one input, become one launch when the AOTInductor engine compiles the
program (zerokv.kernels.sibling_matvecs). Every module keeps its parameters and their names, so the
program's weights are what they were.

The kernel is for CUDA (on the CPU only under Triton's interpreter) and the dtypes in
zerokv.kernels.matvec_contract: a model of another dtype, or a machine that cannot run the kernel,
is refused by name when the model is switched; a layer the kernel cannot take (one whose weight's
dtype is not its input's) is refused by name by the kernel, at export or at its first step.
"""

from __future__ import annotations

import dataclasses

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


class GatedMatvecMLP:
    """Mixed into a gated SiLU MLP's class: one-row inputs take zerokv::gated_matvec."""

    def forward(self, x):
        if contract.is_one_row(x):
            return self.down_proj(torch.ops.zerokv.gated_matvec(x, self.gate_proj.weight, self.up_proj.weight))
        return super().forward(x)


@dataclasses.dataclass(frozen=True)
class Switched:
    linear_layers: int
    gated_mlps: int


def is_gated_silu_mlp(module) -> bool:
    """Whether `module` computes down_proj(SiLU(gate_proj(x)) * up_proj(x)): its forward is Llama's
    MLP's code (transformers copies it into each model that has it), its activation SiLU, and gate
    and up bias-free linear layers of one shape."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP

    forward = getattr(type(module), "forward", None)
    if forward is None or not hasattr(forward, "__code__"):
        return False
    code, llama = forward.__code__, LlamaMLP.forward.__code__
    if (code.co_code, code.co_names, code.co_consts) != (llama.co_code, llama.co_names, llama.co_consts):
        return False
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    return (isinstance(getattr(module, "act_fn", None), (torch.nn.SiLU, SiLUActivation))
            and isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear)
            and gate.bias is None and up.bias is None and gate.weight.shape == up.weight.shape)


_GATED_CLASSES: dict[type, type] = {}


def use_matvec_decode(model) -> Switched:
    """Switches `model`'s linear layers to MatvecLinear and its gated SiLU MLPs to GatedMatvecMLP."""
    if model.dtype not in contract.DTYPES:
        raise DecodeLinearError(f"{model.config.model_type}: one-token linear layers: the model is {model.dtype}; "
                                f"the kernel takes {', '.join(map(str, contract.DTYPES))}")
    _load_kernel()
    linear_layers = gated_mlps = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = MatvecLinear
            linear_layers += 1
        elif is_gated_silu_mlp(module):
            cls = type(module)
            module.__class__ = _GATED_CLASSES.setdefault(cls, type(f"GatedMatvec{cls.__name__}", (GatedMatvecMLP, cls), {}))
            gated_mlps += 1
    return Switched(linear_layers, gated_mlps)


def _load_kernel():
    try:
        from zerokv.kernels import matvec  # registers torch.ops.zerokv.matvec and gated_matvec
    except ImportError as error:
        raise DecodeLinearError(f"one-token linear layers need Triton: {error}") from error
    if not (torch.cuda.is_available() or matvec.INTERPRETED):
        raise DecodeLinearError("one-token linear layers: the kernel is CUDA's; this machine has no CUDA device (on "
                                "the CPU it runs only under Triton's interpreter, TRITON_INTERPRET=1)")
