"""Marks the one-token products whose weights are constants of the program.

zerokv's product kernels (zerokv.kernels.matvec) wait for the kernel before them before they read
anything it may have written (zerokv.kernels.dependent_launch). Called with `constant_weights=True`,
their programs load their first tile of the weights before that wait, so that the weights stream
while the kernel before ends. That is safe only for weights no kernel of the program writes: in the
graph AOTInductor compiles (zerokv.aoti.compile_aoti, after it has refused a program that writes a
buffer), a `get_attr` node, a parameter or constant of the program. A weight computed in the step
(or a graph input, as torch.compile's graphs pass parameters) leaves the call waiting before it
reads anything.

It runs on the graph compile_aoti hands to AOTInductor, after zerokv.kernels.sibling_matvecs has
grouped its products, and on torch.compile's graphs (tools/bench/decode_roofline_profile.py). It
needs no Triton.
"""

from __future__ import annotations

import torch

from zerokv.kernels.sibling_matvecs import op_name

# Each product op and the arguments that are its weights (a tensor, or a list of tensors or None).
WEIGHTS = {
    "zerokv::matvec": ("weight", "bias"),
    "zerokv::gated_matvec": ("gate_weight", "up_weight"),
    "zerokv::matvec_siblings": ("weights", "biases"),
}


def mark_constant_weights(graph: torch.fx.Graph) -> list[str]:
    """Sets constant_weights=True on every product call whose weights and bias are all get_attr
    nodes; returns the names of the calls marked."""
    marked = []
    for node in graph.nodes:
        if node.op != "call_function" or op_name(node.target) not in WEIGHTS:
            continue
        operands = _operands(node)
        weights = []
        for name in WEIGHTS[op_name(node.target)]:
            value = operands.get(name)
            weights += value if isinstance(value, (list, tuple)) else [value]
        if all(weight is None or (isinstance(weight, torch.fx.Node) and weight.op == "get_attr") for weight in weights):
            node.kwargs = {**node.kwargs, "constant_weights": True}
            marked.append(node.name)
    return marked


def _operands(call):
    """A call's operands by their names in the op's schema, each positional or by keyword."""
    target = call.target.default if isinstance(call.target, torch._ops.OpOverloadPacket) else call.target
    names = [argument.name for argument in target._schema.arguments]
    return {**dict(zip(names, call.args)), **call.kwargs}
