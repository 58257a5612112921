"""prefetch_next_weights on exported graphs of decoder-shaped layers: which weights each siblings
launch prefetches, how many bytes of each, where it stops, and that the graph computes what it did.
The kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1, which the Bazel target
sets; it issues no prefetch there), compiled on a CUDA machine (the gpu twin), where the prefetches
are issued."""

import torch

from zerokv.kernels import matvec  # noqa: F401  (registers the ops)
from zerokv.kernels.constant_weights import mark_constant_weights
from zerokv.kernels.kernel_test_device import device_or_skip
from zerokv.kernels.sibling_matvecs import group_sibling_matvecs, op_name
from zerokv.kernels.weight_prefetch import prefetch_next_weights

DEVICE = device_or_skip()
HIDDEN, FFN = 64, 96


class Layers(torch.nn.Module):
    """`layers` decoder-shaped layers of products (attention reduced to q + k * v): q, k, v of x;
    o; gated gate and up; down. With `computed_output`, o's weight is computed in the step."""

    def __init__(self, layers=2, computed_output=False):
        super().__init__()
        torch.manual_seed(0)
        shapes = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, HIDDEN), "v": (HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN),
                  "gate": (FFN, HIDDEN), "up": (FFN, HIDDEN), "down": (HIDDEN, FFN)}
        self.layers = torch.nn.ModuleList(torch.nn.ParameterDict(
            {name: torch.randn(*shape) / shape[1] ** 0.5 for name, shape in shapes.items()}) for _ in range(layers))
        self.computed_output = computed_output

    def forward(self, x):
        for w in self.layers:
            q, k, v = (torch.ops.zerokv.matvec(x, w[name]) for name in "qkv")
            o = w["o"] * 2 if self.computed_output else w["o"]
            x = x + torch.ops.zerokv.matvec(q + k * v, o)
            x = x + torch.ops.zerokv.matvec(torch.ops.zerokv.gated_matvec(x, w["gate"], w["up"]), w["down"])
        return x


def _prefetched(module, budget):
    """(the program, the names of the calls given prefetches, what each siblings call prefetches as
    (the weight's attribute name, bytes), and the outputs before and after)."""
    x = torch.randn(1, 1, HIDDEN, device=DEVICE)
    program = torch.export.export(module.to(DEVICE), (x,)).run_decompositions({}).module()
    want = program(x)
    group_sibling_matvecs(program.graph)
    mark_constant_weights(program.graph)
    given = prefetch_next_weights(program.graph, program, budget)
    program.recompile()
    launches = [node for node in program.graph.nodes if op_name(node.target) == "zerokv::matvec_siblings"]
    prefetches = [[(weight.target, nbytes) for weight, nbytes in zip(*launch.args[3:5])] for launch in launches]
    return given, prefetches, want, program(x)


def _name(layer, weight):
    return f"layers.{layer}.{weight}"


def test_each_layer_prefetches_its_output_projection_then_gate_and_up_within_the_budget():
    o_bytes, gate_bytes = HIDDEN * HIDDEN * 4, FFN * HIDDEN * 4
    budget = o_bytes + gate_bytes  # o whole, then half of what is left each for gate and up
    given, prefetches, want, got = _prefetched(Layers(), budget)
    assert len(given) == 2
    for layer, prefetch in enumerate(prefetches):
        assert prefetch == [(_name(layer, "o"), o_bytes), (_name(layer, "gate"), gate_bytes // 2),
                            (_name(layer, "up"), gate_bytes // 2)]
    torch.testing.assert_close(got, want)


def test_a_small_budget_prefetches_a_part_of_the_first_weight():
    _, prefetches, _, _ = _prefetched(Layers(layers=1), 1000)
    assert prefetches == [[(_name(0, "o"), 1000)]]


def test_a_large_budget_stops_at_the_next_layers_projections():
    """The down projection is the third tensor after o, gate and up: a launch prefetches three."""
    _, prefetches, _, _ = _prefetched(Layers(), 1 << 30)
    assert [target for target, _ in prefetches[0]] == [_name(0, "o"), _name(0, "gate"), _name(0, "up")]
    assert all(nbytes == HIDDEN * HIDDEN * 4 or nbytes == FFN * HIDDEN * 4 for _, nbytes in prefetches[0])


def test_a_weight_computed_in_the_step_is_not_prefetched():
    _, prefetches, want, got = _prefetched(Layers(layers=1, computed_output=True), 1 << 30)
    assert [target for target, _ in prefetches[0]] == [_name(0, "gate"), _name(0, "up"), _name(0, "down")]
    torch.testing.assert_close(got, want)
