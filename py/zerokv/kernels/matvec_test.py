"""zerokv::matvec against torch's linear in float32. On the CPU the kernel runs under Triton's interpreter
(TRITON_INTERPRET=1, which the Bazel target sets); on a CUDA machine (the gpu-tagged target) compiled."""

import pytest
import torch

from zerokv.kernels import matvec as mv
from zerokv.kernels.kernel_test_device import device_or_skip
from zerokv.kernels.matvec_contract import MatvecError

DEVICE = device_or_skip()


def _reference(x, weight, bias):
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())


# (outputs, inputs, bias, dtype, x's shape before its K inputs)
CASES = {
    "even": (64, 256, False, torch.float16, (1, 1)),
    "uneven rows and columns": (37, 100, True, torch.float16, (1,)),
    "one output": (1, 64, True, torch.float32, ()),
    "wide": (16, 2048, False, torch.bfloat16, (1, 1)),
    "long rows, a partial last load": (5, 9000, True, torch.bfloat16, (1, 1)),
    "float32": (96, 48, False, torch.float32, (1, 1, 1)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_linear(case):
    outputs, inputs, with_bias, dtype, leading = CASES[case]
    torch.manual_seed(0)
    weight = torch.randn(outputs, inputs, dtype=dtype, device=DEVICE) / inputs ** 0.5
    bias = torch.randn(outputs, dtype=dtype, device=DEVICE) if with_bias else None
    x = torch.randn(*leading, inputs, dtype=dtype, device=DEVICE)
    got = torch.ops.zerokv.matvec(x, weight, bias)
    assert got.shape == (*leading, outputs) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _reference(x, weight, bias), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("outputs, inputs", [(64, 256), (37, 100)])
def test_gated_matches_silu_of_gate_times_up(outputs, inputs):
    torch.manual_seed(0)
    gate, up = (torch.randn(outputs, inputs, dtype=torch.float16, device=DEVICE) / inputs ** 0.5 for _ in "gu")
    x = torch.randn(1, 1, inputs, dtype=torch.float16, device=DEVICE)
    want = torch.nn.functional.silu(_reference(x, gate, None)) * _reference(x, up, None)
    torch.testing.assert_close(torch.ops.zerokv.gated_matvec(x, gate, up).float(), want, rtol=2e-2, atol=2e-2)


def test_gated_reads_an_up_weight_of_its_own_row_stride():
    torch.manual_seed(0)
    gate = torch.randn(24, 64, dtype=torch.float16, device=DEVICE) / 8
    up = torch.randn(24, 96, dtype=torch.float16, device=DEVICE)[:, :64] / 8  # rows 96 apart
    x = torch.randn(64, dtype=torch.float16, device=DEVICE)
    want = torch.nn.functional.silu(_reference(x, gate, None)) * _reference(x, up, None)
    torch.testing.assert_close(torch.ops.zerokv.gated_matvec(x, gate, up).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("up, message", [
    (torch.zeros(4, 6), r"gated_matvec: up's shape \[4, 6\] is not weight's \[4, 8\]"),
    (torch.zeros(8, 4).T, r"gated_matvec: up's rows must be contiguous"),
    (torch.zeros(4, 8, dtype=torch.float16), r"gated_matvec: up is torch.float16, x torch.float32"),
])
def test_gated_refuses_an_up_weight_unlike_the_gate_by_name(up, message):
    with pytest.raises(MatvecError, match=message):
        torch.ops.zerokv.gated_matvec(torch.zeros(1, 8), torch.zeros(4, 8), up)


def test_reads_only_the_weights_rows_and_columns():
    """The weight is a view into poisoned storage: NaN past its last row and its last column."""
    torch.manual_seed(0)
    storage = torch.full((40, 120), float("nan"), dtype=torch.float16, device=DEVICE)
    weight = storage[:37, :100]
    weight.copy_(torch.randn(37, 100, dtype=torch.float16))
    x = torch.randn(100, dtype=torch.float16, device=DEVICE)
    for block_n, block_k in ((8, 64), (16, 128), (64, 256)):
        out = torch.empty(37, dtype=torch.float16, device=DEVICE)
        mv.launch(x, weight, None, out, block_n, block_k, num_warps=4)
        torch.testing.assert_close(out.float(), _reference(x, weight, None), rtol=2e-2, atol=2e-2)


REFUSALS = {
    "two rows": (lambda: (torch.zeros(2, 8), torch.zeros(4, 8), None), r"x must hold one row .* \[2, 8\]"),
    "scalar x": (lambda: (torch.tensor(1.0), torch.zeros(4, 1), None), r"x must hold one row .* not \[\]"),
    "inputs": (lambda: (torch.zeros(1, 8), torch.zeros(4, 6), None), r"weight's shape \[4, 6\] does not take x's 8"),
    "weight rank": (lambda: (torch.zeros(1, 8), torch.zeros(8), None), r"weight must be \[N, K\], not \[8\]"),
    "empty": (lambda: (torch.zeros(1, 0), torch.zeros(4, 0), None), r"weight's shape \[4, 0\] is empty"),
    "column-major weight": (lambda: (torch.zeros(1, 8), torch.zeros(8, 4).T, None), r"rows must be contiguous"),
    "bias": (lambda: (torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(5)), r"bias's shape \[5\] is not \[N\]"),
    "dtype": (lambda: (torch.zeros(1, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32), None),
              r"x is torch.int32; the kernel takes"),
    "mixed dtypes": (lambda: (torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.float16), None),
                     r"weight is torch.float16, x torch.float32"),
    "device": (lambda: (torch.zeros(1, 8), torch.zeros(4, 8, device="meta"), None), r"weight is on meta, x on cpu"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refuses_by_name(case):
    make, message = REFUSALS[case]
    with pytest.raises(MatvecError, match=message):
        torch.ops.zerokv.matvec(*make())


def test_strided_inputs_are_read_as_their_values():
    """A one-row x and a bias that are views with strides: what the kernel reads is their values."""
    torch.manual_seed(0)
    weight = torch.randn(24, 64, dtype=torch.float16, device=DEVICE) / 8
    x = torch.randn(64, 2, dtype=torch.float16, device=DEVICE)[:, 0]
    bias = torch.randn(48, dtype=torch.float16, device=DEVICE)[::2]
    torch.testing.assert_close(torch.ops.zerokv.matvec(x, weight, bias).float(), _reference(x, weight, bias),
                               rtol=2e-2, atol=2e-2)


def test_a_weight_of_one_column_takes_any_stride():
    weight = torch.randn(1, 8, device=DEVICE).T  # [8, 1], stride (1, 8)
    x = torch.randn(1, device=DEVICE)
    torch.testing.assert_close(torch.ops.zerokv.matvec(x, weight, None), _reference(x, weight, None))


# (rows of each weight, which have a bias, x's inputs)
SIBLINGS = {
    "query, key and value": ([64, 16, 16], [False, False, False], 256),
    "uneven, some biased": ([37, 8, 5], [True, False, True], 100),
    "two": ([6, 33], [False, True], 48),
}


@pytest.mark.parametrize("case", SIBLINGS)
def test_siblings_are_what_matvec_computes_alone(case):
    """Each product in the shared launch is computed by the same code and blocks as alone: equal."""
    rows, biased, inputs = SIBLINGS[case]
    torch.manual_seed(0)
    x = torch.randn(1, 1, inputs, dtype=torch.float16, device=DEVICE)
    weights = [torch.randn(n, inputs, dtype=torch.float16, device=DEVICE) / inputs ** 0.5 for n in rows]
    biases = [torch.randn(n, dtype=torch.float16, device=DEVICE) if b else None for n, b in zip(rows, biased)]
    got = torch.ops.zerokv.matvec_siblings(x, weights, biases)
    assert len(got) == len(weights)
    for product, weight, bias in zip(got, weights, biases):
        assert torch.equal(product, torch.ops.zerokv.matvec(x, weight, bias))


SIBLING_REFUSALS = {
    "one weight": (1, lambda w: (w, [None]), r"matvec_siblings: 2 to 3 weights with a bias \(or None\) each, not 1 weights"),
    "four weights": (4, lambda w: (w, [None] * 4), r"not 4 weights and 4 biases"),
    "biases": (2, lambda w: (w, [None]), r"not 2 weights and 1 biases"),
    "a weight's inputs": (3, lambda w: (w[:2] + [torch.zeros(4, 6)], [None] * 3),
                          r"matvec_siblings: weights\[2\]: weight's shape \[4, 6\] does not take x's 8"),
    "a bias": (2, lambda w: (w, [None, torch.zeros(5)]), r"matvec_siblings: weights\[1\]: bias's shape \[5\]"),
}


@pytest.mark.parametrize("case", SIBLING_REFUSALS)
def test_siblings_refuse_by_name(case):
    count, make, message = SIBLING_REFUSALS[case]
    with pytest.raises(MatvecError, match=message):
        torch.ops.zerokv.matvec_siblings(torch.zeros(1, 8), *make([torch.zeros(4, 8) for _ in range(count)]))


def test_launch_refuses_a_block_that_is_not_a_power_of_two():
    x, weight = torch.zeros(8, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(MatvecError, match="block_k 96 is not a power of two"):
        mv.launch(x, weight, None, torch.empty(4, device=DEVICE), 4, 96, num_warps=4)


def test_exports_on_the_cpu():
    """The decode programs are exported from CPU tensors and compiled for CUDA: the op's fake asks no
    device."""

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32, 64))

        def forward(self, x):
            return torch.ops.zerokv.matvec(x, self.weight, None)

    program = torch.export.export(Step(), (torch.randn(1, 1, 64),))
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.zerokv.matvec.default in targets
