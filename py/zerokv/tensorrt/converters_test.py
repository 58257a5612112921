"""Each converter family built into a real TensorRT-RTX plan, and checked against eager.

`test_builds_a_plan` runs everywhere: it asserts the layers the converter should
produce are in the network and that a plan is built.
`test_reference_evaluation_matches_eager` runs the built network through a
PyTorch model of TensorRT's layer semantics (not TensorRT itself) and compares
with eager. `test_matches_eager` runs
the plan and compares with eager PyTorch; it needs a GPU on which TensorRT can
deserialize the plan, and is skipped with that reason elsewhere.
"""

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from zerokv.blob.torch_dtypes import TORCH_DTYPES
from zerokv.tensorrt import build_network, decode_and_prefill_profiles, import_tensorrt
from zerokv.tensorrt.converters import CONVERTERS, converts
from zerokv.tensorrt.engine_runner import EngineRunner, EngineUnavailable
from zerokv.tensorrt.network import torch_dtype, trt_dtype
from zerokv.tensorrt.reference_evaluator import evaluate_network
from zerokv.tensorrt.testing_models import TinyDecoder, arange_plus_offset, export_decoder

trt = import_tensorrt()


def test_a_converter_is_registered_once_and_only_through_converts():
    add = torch.ops.aten.add.Tensor
    with pytest.raises(TypeError):
        CONVERTERS[add] = CONVERTERS[torch.ops.aten.sub.Tensor]
    with pytest.raises(ValueError, match="two converters registered for aten.add.Tensor"):
        converts(torch.ops.aten.erfinv.default, add)(lambda ctx, node: None)
    assert torch.ops.aten.erfinv.default not in CONVERTERS


def test_every_blob_dtype_has_its_tensorrt_type_and_back():
    assert [trt_dtype(t) for t in (torch.bfloat16, torch.bool, torch.int64)] == [trt.bfloat16, trt.bool, trt.int64]
    for torch_type in TORCH_DTYPES.values():
        assert torch_dtype(trt_dtype(torch_type)) is torch_type
    with pytest.raises(ValueError, match="torch.float64 has no TensorRT equivalent"):
        trt_dtype(torch.float64)


class Lambda(torch.nn.Module):
    def __init__(self, function, **parameters):
        super().__init__()
        self.function = function
        for name, value in parameters.items():
            self.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))

    def forward(self, *args):
        return self.function(self, *args)


@dataclasses.dataclass
class Case:
    name: str
    module: torch.nn.Module
    inputs: tuple
    layer_types: tuple[str, ...]
    dynamic_shapes: object = None
    tolerance: float = 1e-4


def rotary(m, x, positions):
    angles = positions[:, None].float() * m.inv_freq[None, :]
    table = torch.cat((angles, angles), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * table.cos() + rotated * table.sin()


def rms_norm(m, x):
    return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


sequence = torch.export.Dim("sequence", min=1, max=8)

CASES = [
    Case(
        "embedding",
        Lambda(lambda m, ids: F.embedding(ids, m.weight), weight=torch.randn(16, 8)),
        (torch.tensor([[1, 5, 3]]),),
        ("GATHER",),
    ),
    Case(
        "linear_with_bias",
        torch.nn.Linear(8, 12),
        (torch.randn(2, 3, 8),),
        ("MATRIX_MULTIPLY", "ELEMENTWISE"),
    ),
    Case(
        "matmul_and_bmm",
        Lambda(lambda m, a, b: torch.matmul(a, b) + torch.bmm(a, b)),
        (torch.randn(2, 3, 4), torch.randn(2, 4, 5)),
        ("MATRIX_MULTIPLY",),
    ),
    Case(
        "elementwise_arithmetic",
        Lambda(lambda m, a, b: (a + 2.0) * b - a / (b.abs() + 1.0) - 3 * a),
        (torch.randn(2, 4), torch.randn(4)),
        ("ELEMENTWISE",),
    ),
    Case("rms_norm", Lambda(rms_norm, weight=torch.randn(8)), (torch.randn(1, 3, 8),), ("REDUCE", "UNARY")),
    Case("silu", Lambda(lambda m, x: F.silu(x)), (torch.randn(3, 8),), ("ACTIVATION",)),
    Case("gelu_erf", Lambda(lambda m, x: F.gelu(x)), (torch.randn(3, 8),), ("UNARY",)),
    Case("gelu_tanh", Lambda(lambda m, x: F.gelu(x, approximate="tanh")), (torch.randn(3, 8),), ("ACTIVATION",)),
    Case("softmax", Lambda(lambda m, x: torch.softmax(x, dim=-1)), (torch.randn(2, 5),), ("SOFTMAX",)),
    Case(
        "sdpa_float_mask",
        Lambda(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        (torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(3, 6)),
        ("MATRIX_MULTIPLY", "SOFTMAX"),
    ),
    Case(
        "sdpa_bool_mask_and_scale",
        Lambda(
            lambda m, q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.arange(6)[None, :] <= torch.arange(3)[:, None] + 3, scale=0.3
            )
        ),
        (torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)),
        ("SELECT", "SOFTMAX"),
    ),
    Case(
        "rotary_embedding",
        Lambda(rotary, inv_freq=1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))),
        (torch.randn(1, 2, 5, 8), torch.arange(5) + 3),
        ("UNARY", "SLICE", "CONCATENATION"),
    ),
    Case(
        "rotary_embedding_dynamic_length",
        Lambda(
            lambda m, x, offset: rotary(m, x, torch.arange(x.shape[2]) + offset),
            inv_freq=1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)),
        ),
        (torch.randn(1, 2, 5, 8), torch.tensor([3])),
        ("FILL", "SLICE", "CONCATENATION"),
        dynamic_shapes=({2: sequence}, None),
    ),
    Case(
        "layout_ops",
        Lambda(
            lambda m, x: x.view(2, 3, 2, 2).transpose(1, 2).permute(0, 2, 3, 1).reshape(2, -1).unsqueeze(1).expand(2, 4, 12)
        ),
        (torch.randn(2, 3, 4),),
        ("SHUFFLE", "SLICE"),
    ),
    Case(
        "layout_ops_dynamic",
        Lambda(lambda m, x: x.view(1, x.shape[1], 2, 4).transpose(1, 2).reshape(1, 2, -1).unsqueeze(0).expand(3, 1, 2, -1)),
        (torch.randn(1, 5, 8),),
        ("SHUFFLE", "SLICE"),
        dynamic_shapes=({1: sequence},),
    ),
    Case(
        "dtype_casts",
        Lambda(lambda m, x, ids: x.to(torch.float16).float() + ids.to(torch.float32)),
        (torch.randn(4), torch.tensor([1, 2, 3, 4])),
        ("CAST",),
        tolerance=1e-3,
    ),
    Case(
        "comparisons_and_where",
        Lambda(lambda m, a, b: torch.where(a > b, a, b * 2.0) + (a <= 0.5).float()),
        (torch.randn(3, 4), torch.randn(3, 4)),
        ("SELECT",),
    ),
]


def export(case: Case):
    with torch.no_grad():
        # Lambda.forward takes *args: its dynamic shapes nest one level deeper.
        dynamic_shapes = None if case.dynamic_shapes is None else (case.dynamic_shapes,)
        return torch.export.export(case.module.eval(), case.inputs, dynamic_shapes=dynamic_shapes)


def layer_types(network):
    return {str(network.get_layer(i).type).rsplit(".", 1)[-1] for i in range(network.num_layers)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_builds_a_plan(case):
    built = build_network(export(case))
    missing = set(case.layer_types) - layer_types(built.network)
    assert not missing, f"expected {missing} among {layer_types(built.network)}"
    engine = built.build()
    assert len(engine.serialized_plan) > 0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_evaluation_matches_eager(case):
    # The built network run by a PyTorch model of TensorRT's layer semantics:
    # catches converter mistakes on machines where no engine can run.
    built = build_network(export(case))
    user_inputs = [b.name for b in built.io_bindings if b.role == "user_input"]
    outputs = evaluate_network(built.network, dict(zip(user_inputs, case.inputs)))
    with torch.no_grad():
        expected = case.module(*case.inputs)
    torch.testing.assert_close(outputs["output_0"], expected, atol=case.tolerance, rtol=case.tolerance)


def _runner_or_skip(engine):
    try:
        return EngineRunner(engine)
    except EngineUnavailable as unavailable:
        pytest.skip(f"only built, not executed: {unavailable}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_eager(case):
    program = export(case)
    engine = build_network(program).build()
    runner = _runner_or_skip(engine)
    user_inputs = [b.name for b in engine.io_bindings if b.role == "user_input"]
    outputs = runner.run({name: t.cuda().contiguous() for name, t in zip(user_inputs, case.inputs)})
    with torch.no_grad():
        expected = case.module(*case.inputs)
    torch.testing.assert_close(outputs["output_0"].cpu(), expected, atol=case.tolerance, rtol=case.tolerance)


def test_decoder_prefill_then_decode_matches_eager_and_writes_caches_in_place():
    model = TinyDecoder(arange_plus_offset)
    program = export_decoder(model, length=4, offset=torch.tensor([0]), dynamic_length=True, max_length=8)
    engine = build_network(program, decode_and_prefill_profiles("input_ids", 1, max_prefill=8)).build()
    runner = _runner_or_skip(engine)
    caches = {name: torch.zeros(1, 2, 32, 16, device="cuda") for name in ("layer.k_cache", "layer.v_cache")}
    addresses = {name: cache.data_ptr() for name, cache in caches.items()}
    prompt, decode_token = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 1))
    steps = [(prompt, torch.tensor([0]), 1), (decode_token, torch.tensor([5]), 0)]
    for input_ids, offset, profile in steps:
        with torch.no_grad():
            expected = model(input_ids, offset)
        outputs = runner.run({"input_ids": input_ids.cuda(), "offset": offset.cuda(), **caches}, profile=profile)
        torch.testing.assert_close(outputs["output_0"].cpu(), expected, atol=1e-4, rtol=1e-4)
        for name, cache in caches.items():
            assert outputs[f"{name}.updated"].data_ptr() == addresses[name]
            torch.testing.assert_close(cache.cpu(), getattr(model.layer, name.split(".")[1]))
