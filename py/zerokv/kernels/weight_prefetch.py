"""Has each layer's query, key and value launch start the weights of the layer's later products on
their way into L2, so that they stream while the memory would otherwise idle.

In a decode step the products stream their weights at close to the memory's bandwidth, one after
the other, each launched early behind the one before (zerokv.kernels.dependent_launch). Between
a layer's query, key and value (zerokv::matvec_siblings) and its output projection runs a chain of
short dependent kernels that read little: the rotary embedding, the cache writes, attention's
splits and their combination. The memory idles through it. prefetch_next_weights gives each
siblings call the weights of the products that follow it in the graph, up to the next siblings
call (the output projection's, then the gated MLP's gate and up, which it reads together, so half
of what is left each), up to `budget` bytes: its programs issue bulk prefetches of them into L2
once they have computed their rows (zerokv.kernels.l2_prefetch), and the products after it find
those bytes there.

A prefetch moves no value anywhere a kernel reads, so it cannot change what the step computes. Only
weights that are the program's constants (`get_attr` nodes, defined before the call) are
prefetched. It runs on the graph AOTInductor compiles (zerokv.aoti.compile_aoti), after
zerokv.kernels.sibling_matvecs has grouped the projections. It needs no Triton.
"""

from __future__ import annotations

import torch

from zerokv.kernels.constant_weights import WEIGHTS, operands_by_name
from zerokv.kernels.matvec_contract import MAX_PREFETCHES
from zerokv.kernels.sibling_matvecs import op_name

SIBLINGS = "zerokv::matvec_siblings"
# L2 bytes a siblings launch prefetches: Llama-3.2-1B's output projection (8 MiB) and 8 MiB of each
# of gate and up, against the H200's 50 MiB of L2, which attention's reads of the cache share.
BUDGET_BYTES = 24 << 20


def prefetch_next_weights(graph: torch.fx.Graph, owner: torch.nn.Module, budget: int = BUDGET_BYTES) -> list[str]:
    """Sets the prefetch of every zerokv::matvec_siblings call to the constant weights of the
    products after it, up to the next siblings call and `budget` bytes; returns the names of the
    calls given some. `owner`: the module whose attributes the get_attr nodes name."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    products = [node for node in graph.nodes if node.op == "call_function" and op_name(node.target) in WEIGHTS]
    given = []
    for index, call in enumerate(products):
        if op_name(call.target) != SIBLINGS:
            continue
        targets, left = [], budget
        for later in products[index + 1:]:
            if op_name(later.target) == SIBLINGS or left <= 0 or len(targets) == MAX_PREFETCHES:
                break
            weights = [weight for weight in _weights(later)
                       if weight.op == "get_attr" and order[weight] < order[call] and _tensor(owner, weight) is not None]
            share = left // max(len(weights), 1)
            for weight in weights[:MAX_PREFETCHES - len(targets)]:
                taken = min(share, _tensor(owner, weight).nbytes)
                targets.append((weight, taken))
                left -= taken
        if targets:
            call.args = (*call.args[:3], [weight for weight, _ in targets], [taken for _, taken in targets])
            given.append(call.name)
    graph.lint()
    return given


def _weights(call):
    """The weight nodes (not biases) a product call reads, in the order its kernel reads them."""
    operands = operands_by_name(call)
    weights = []
    for name in WEIGHTS[op_name(call.target)]:
        if name in ("bias", "biases"):
            continue
        value = operands.get(name)
        weights += value if isinstance(value, (list, tuple)) else [value]
    return [weight for weight in weights if isinstance(weight, torch.fx.Node)]


def _tensor(owner, node):
    value = owner
    for name in node.target.split("."):
        value = getattr(value, name, None)
    return value if isinstance(value, torch.Tensor) and value.is_contiguous() else None
