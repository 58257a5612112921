"""mark_constant_weights on exported graphs: which product calls it marks (weights that are the
program's constants), which it leaves (a weight computed in the step, a graph input), and that a
marked graph computes what it did. The kernels run under Triton's interpreter on the CPU
(TRITON_INTERPRET=1, which the Bazel target sets), compiled on a CUDA machine (the gpu twin)."""

import torch

from zerokv.kernels import matvec  # noqa: F401  (registers the ops)
from zerokv.kernels.constant_weights import mark_constant_weights
from zerokv.kernels.kernel_test_device import device_or_skip
from zerokv.kernels.sibling_matvecs import group_sibling_matvecs

DEVICE = device_or_skip()

INPUTS = 32


class Step(torch.nn.Module):
    """A gated product, three siblings, one product with a bias, and one of a weight the step computes."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Parameter(torch.randn(16, INPUTS)), torch.nn.Parameter(torch.randn(16, INPUTS))
        self.query, self.key, self.value = (torch.nn.Parameter(torch.randn(8, INPUTS)) for _ in range(3))
        self.bias = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        gated = torch.ops.zerokv.gated_matvec(x, self.gate, self.up)
        query, key, value = (torch.ops.zerokv.matvec(x, weight) for weight in (self.query, self.key, self.value))
        biased = torch.ops.zerokv.matvec(x, self.query, self.bias)
        computed = torch.ops.zerokv.matvec(x, self.query * gated.sum())
        return gated, query, key, value, biased, computed


def _marked():
    torch.manual_seed(0)
    x = torch.randn(1, 1, INPUTS, device=DEVICE)
    program = torch.export.export(Step().to(DEVICE), (x,)).module()
    want = program(x)
    groups = group_sibling_matvecs(program.graph)
    marked = mark_constant_weights(program.graph)
    program.recompile()
    got = program(x)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    return groups, marked, {node.name: node for node in program.graph.nodes}


def test_calls_whose_weights_are_the_programs_are_marked():
    groups, marked, nodes = _marked()
    assert [len(group) for group in groups] == [3]  # query, key, value; the biased one after them alone
    kinds = sorted(str(nodes[name].target) for name in marked)
    assert kinds == ["zerokv.gated_matvec.default", "zerokv.matvec.default", "zerokv.matvec_siblings.default"]


def test_a_weight_computed_in_the_step_is_not_marked():
    _, marked, nodes = _marked()
    unmarked = [node for node in nodes.values() if node.op == "call_function" and "zerokv" in str(node.target)
                and node.name not in marked]
    assert len(unmarked) == 1
    [computed] = unmarked
    assert computed.args[1].op == "call_function" and "constant_weights" not in computed.kwargs


def test_a_weight_that_is_a_graph_input_is_not_marked():
    """torch.compile's graphs take a module's parameters as inputs; nothing says no kernel writes them."""
    graph = torch.fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    graph.output(graph.call_function(torch.ops.zerokv.matvec, (), {"x": x, "weight": weight}))
    assert mark_constant_weights(graph) == []


def test_operands_by_keyword_and_packets_are_read():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    gate, up = graph.get_attr("gate"), graph.get_attr("up")
    call = graph.call_function(torch.ops.zerokv.gated_matvec, (x,), {"gate_weight": gate, "up_weight": up})
    graph.output(call)
    assert mark_constant_weights(graph) == [call.name]
    assert call.kwargs["constant_weights"] is True


def test_constant_weights_compute_the_same_values():
    """Under the interpreter there is no wait, and the flag changes nothing; the GPU twin compares
    the kernels with the first tile loaded before the wait and after it."""
    torch.manual_seed(0)
    x, weight, up = (torch.randn(*shape, device=DEVICE) for shape in ((1, 1, 64), (24, 64), (24, 64)))
    assert torch.equal(torch.ops.zerokv.matvec(x, weight, constant_weights=True), torch.ops.zerokv.matvec(x, weight))
    assert torch.equal(torch.ops.zerokv.gated_matvec(x, weight, up, constant_weights=True),
                       torch.ops.zerokv.gated_matvec(x, weight, up))
