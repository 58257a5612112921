"""Groups a graph's one-token products of one input into zerokv::matvec_siblings launches.

A decoder's attention reads its normed input through three projections (query, key and value):
three zerokv::matvec calls on one x. On the H200, Llama-3.2-1B's three took 8.5 us a layer as three
launches and 5.2 us as one (//tools/bench:matvec_bench): alone, the key's and value's [512, 2048]
weights are read at 0.9 TB/s.

The grouping is exact: each product's rows are computed by the same code with the same blocks as a
matvec call computes them. A call joins the first call of its group only if its weight and bias
are defined before that first call, which the launch replaces; otherwise it stays a call of its own.

It runs on the graph AOTInductor compiles (zerokv.aoti.compile_aoti), for ExecuTorch's edge ops as
for ATen's, and on torch.compile's graphs (tools/bench/decode_roofline_profile.py). It needs no
Triton: a graph holding zerokv::matvec calls was traced with the kernels loaded, which registered
zerokv::matvec_siblings too.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from zerokv.kernels.matvec_contract import MAX_SIBLINGS

MATVEC = "zerokv::matvec"


def group_sibling_matvecs(graph: torch.fx.Graph) -> list[list[str]]:
    """Replaces each run of 2 to MAX_SIBLINGS zerokv::matvec calls on one input with one
    zerokv::matvec_siblings call; returns the names of the calls grouped, launch by launch."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    calls_by_input = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and op_name(node.target) == MATVEC:
            calls_by_input[_operands(node)[0]].append(node)
    groups = []
    for x, calls in calls_by_input.items():
        while len(calls) > 1:
            first = calls[0]
            group = [first] + [call for call in calls[1:]
                               if all(order[operand] < order[first] for operand in _operands(call)[1:]
                                      if isinstance(operand, torch.fx.Node))]
            group = group[:MAX_SIBLINGS]
            calls = [call for call in calls[1:] if call not in group]
            if len(group) > 1:
                _replace(graph, x, group)
                groups.append([call.name for call in group])
    graph.lint()
    return groups


def op_name(target):
    """An operator's name, whether the call names its overload (torch.export, ExecuTorch's edge
    ops) or its packet (torch.compile's graphs)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    return getattr(getattr(target, "_schema", None), "name", None)


def _operands(call):
    """(x, weight, bias or None) of a matvec call, each positional or by keyword."""
    named = {**dict(zip(("x", "weight", "bias"), call.args)), **call.kwargs}
    return named["x"], named["weight"], named.get("bias")


def _replace(graph, x, group):
    operands = [_operands(call) for call in group]
    with graph.inserting_before(group[0]):
        launch = graph.call_function(torch.ops.zerokv.matvec_siblings.default,
                                     (x, [weight for _, weight, _ in operands], [bias for _, _, bias in operands]))
    if all("val" in call.meta for call in group):
        launch.meta["val"] = [call.meta["val"] for call in group]
    for index, call in enumerate(group):
        with graph.inserting_before(group[0]):
            product = graph.call_function(operator.getitem, (launch, index))
        product.meta = dict(call.meta)
        call.replace_all_uses_with(product)
    for call in group:
        graph.erase_node(call)
