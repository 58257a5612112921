"""group_sibling_matvecs on exported graphs: which calls it groups, which it leaves, and that the
grouped graph computes what it did. The kernels run under Triton's interpreter on the CPU
(TRITON_INTERPRET=1, which the Bazel target sets), compiled on a CUDA machine (the gpu twin)."""

import pytest
import torch

from zerokv.kernels import matvec  # noqa: F401  (registers the ops)
from zerokv.kernels.kernel_test_device import device_or_skip
from zerokv.kernels.sibling_matvecs import group_sibling_matvecs

DEVICE = device_or_skip()

INPUTS = 32


class Products(torch.nn.Module):
    """`count` products of x and, with `late`, one more of a weight computed after the first."""

    def __init__(self, count, late=False):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.randn(8 + i, INPUTS) for i in range(count))
        self.biases = torch.nn.ParameterList(torch.randn(8 + i) for i in range(count))
        self.late = late

    def forward(self, x, y):
        outs = [torch.ops.zerokv.matvec(x, weight, bias if index % 2 else None)
                for index, (weight, bias) in enumerate(zip(self.weights, self.biases))]
        outs.append(torch.ops.zerokv.matvec(y, self.weights[0]))  # another input: alone
        if self.late:
            outs.append(torch.ops.zerokv.matvec(x, self.weights[0] * outs[0].sum()))
        return tuple(outs)


def _inputs():
    """x and y: two tensors (one passed twice would be one input of the exported graph)."""
    return torch.randn(1, 1, INPUTS, device=DEVICE), torch.randn(1, 1, INPUTS, device=DEVICE)


def _grouped(module):
    torch.manual_seed(0)
    inputs = _inputs()
    program = torch.export.export(module.to(DEVICE), inputs).module()
    want = program(*inputs)
    groups = group_sibling_matvecs(program.graph)
    program.recompile()
    got = program(*inputs)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    return groups, [str(node.target) for node in program.graph.nodes if node.op == "call_function"]


def test_three_products_of_one_input_are_one_launch():
    groups, targets = _grouped(Products(3))
    assert [len(group) for group in groups] == [3]
    assert targets.count("zerokv.matvec_siblings.default") == 1
    assert targets.count("zerokv.matvec.default") == 1  # y's


def test_more_than_three_are_launches_of_three_and_the_rest():
    groups, targets = _grouped(Products(5))
    assert [len(group) for group in groups] == [3, 2]
    assert targets.count("zerokv.matvec.default") == 1


def test_a_weight_computed_after_the_first_product_stays_alone():
    """The launch takes the first call's place; a weight made from that call's output is not there yet."""
    groups, targets = _grouped(Products(2, late=True))
    assert [len(group) for group in groups] == [2]
    assert targets.count("zerokv.matvec.default") == 2  # y's and the late one


def test_nothing_to_group_leaves_the_graph_as_it_was():
    program = torch.export.export(Products(1).to(DEVICE), _inputs())
    before = str(program.graph)
    assert group_sibling_matvecs(program.graph) == []
    assert str(program.graph) == before


def test_operands_by_keyword_are_read():
    """torch.export passes them positionally; a graph may name them (torch.compile's keeps the call's)."""
    graph = torch.fx.Graph()
    x, query, key = (graph.placeholder(name) for name in ("x", "query", "key"))
    first = graph.call_function(torch.ops.zerokv.matvec.default, (), {"x": x, "weight": query})
    second = graph.call_function(torch.ops.zerokv.matvec.default, (x,), {"weight": key, "bias": None})
    graph.output((first, second))
    names = [first.name, second.name]
    assert group_sibling_matvecs(graph) == [names]
    launch = next(node for node in graph.nodes if node.target == torch.ops.zerokv.matvec_siblings.default)
    assert launch.args == (x, [query, key], [None, None])


def test_executorchs_edge_ops_are_grouped():
    """The AOTInductor engine compiles partitions of an edge program, whose calls are edge ops."""
    to_edge = pytest.importorskip("executorch.exir", reason="ExecuTorch is not installed (the GPU machine)").to_edge

    edge = to_edge(torch.export.export(Products(3).to(DEVICE), _inputs())).exported_program()
    assert [len(group) for group in group_sibling_matvecs(edge.graph)] == [3]
