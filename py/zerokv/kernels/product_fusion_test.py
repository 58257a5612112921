"""fuse_rms_norms and fuse_residual_additions on exported graphs of transformers' own RMS norms: what
they fold, what they leave, and that the folded graph computes what it did (to rounding). The
kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1, which the Bazel target sets),
compiled on a CUDA machine (the gpu twin). Whole Hugging Face decoders go through them in
zerokv/executorch/hf_decode_kernels_steps_test.py."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from zerokv.kernels import matvec  # noqa: F401  (registers the ops)
from zerokv.kernels.kernel_test_device import device_or_skip
from zerokv.kernels.product_fusion import fuse_residual_additions, fuse_rms_norms
from zerokv.kernels.sibling_matvecs import group_sibling_matvecs, op_name

DEVICE = device_or_skip()
HIDDEN, EPS = 64, 1e-5
NORM_OPS = {"aten::rsqrt", "aten::pow", "aten::mean"}


class Layer(torch.nn.Module):
    """A decoder layer's products around its norms and residual additions (the attention reduced to
    q + k * v): q, k, v of norm(x); h = x + o(...); gated gate/up of norm(h); h + down(...)."""

    def __init__(self, norm=LlamaRMSNorm, dtype=torch.float16, reread_output=False):
        super().__init__()
        torch.manual_seed(0)
        self.input_norm, self.post_norm = norm(HIDDEN, eps=EPS), norm(HIDDEN, eps=EPS)
        with torch.no_grad():
            for module in (self.input_norm, self.post_norm):
                module.weight.uniform_(0.5, 1.5)
        self.weights = torch.nn.ParameterDict({name: torch.randn(rows, HIDDEN) / HIDDEN ** 0.5 for name, rows in (
            ("q", HIDDEN), ("k", HIDDEN), ("v", HIDDEN), ("o", HIDDEN), ("gate", 96), ("up", 96))})
        self.weights["down"] = torch.randn(HIDDEN, 96) / 96 ** 0.5
        self.reread_output = reread_output
        self.to(DEVICE, dtype)

    def forward(self, x):
        w = self.weights
        normed = self.input_norm(x)
        q, k, v = (torch.ops.zerokv.matvec(normed, w[name]) for name in "qkv")
        attended = torch.ops.zerokv.matvec(q + k * v, w["o"])
        h = x + attended
        mlp = torch.ops.zerokv.gated_matvec(self.post_norm(h), w["gate"], w["up"])
        out = h + torch.ops.zerokv.matvec(mlp, w["down"])
        return (out, attended) if self.reread_output else out


def _x(dtype=torch.float16):
    torch.manual_seed(1)
    return 3 * torch.randn(1, 1, HIDDEN, dtype=dtype, device=DEVICE)  # far from unit RMS: a lost scale shows


def _fused(layer, x):
    """(norms folded, additions folded, ops left, the program before and after)."""
    module = torch.export.export(layer, (x,)).run_decompositions({}).module()
    want = module(x)
    group_sibling_matvecs(module.graph)
    norms, additions = fuse_rms_norms(module.graph, module), fuse_residual_additions(module.graph)
    module.recompile()
    ops = [op_name(node.target) for node in module.graph.nodes if node.op == "call_function"]
    return norms, additions, ops, want, module(x), module


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_llamas_norms_and_residual_additions_go_into_the_products(dtype):
    x = _x(dtype)
    norms, additions, ops, want, got, module = _fused(Layer(dtype=dtype), x)
    assert len(norms) == 2 and len(additions) == 2
    assert not NORM_OPS & set(ops) and ops.count("aten::add") == 1  # the attention's q + k * v
    assert ops.count("zerokv::matvec_siblings") == ops.count("zerokv::gated_matvec") == 1
    products = [node for node in module.graph.nodes if node.op == "call_function" and op_name(node.target) in (
        "zerokv::matvec_siblings", "zerokv::gated_matvec")]
    assert all(node.kwargs["norm_eps"] == pytest.approx(EPS) for node in products)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_an_eps_held_as_a_constant_tensor_is_read():
    """ExecuTorch's edge programs hold the eps as a lifted constant, not a number."""
    layer, x = Layer(), _x()
    module = torch.export.export(layer, (x,)).run_decompositions({}).module()
    module.register_buffer("eps_constant", torch.tensor(4.0, device=DEVICE))
    for add in [node for node in module.graph.nodes if op_name(node.target) == "aten::add" and EPS in node.args]:
        with module.graph.inserting_before(add):
            add.args = (add.args[0], module.graph.get_attr("eps_constant"))
    module.recompile()
    want = module(x)
    group_sibling_matvecs(module.graph)
    assert len(fuse_rms_norms(module.graph, module)) == 2
    assert "eps_constant" not in [node.target for node in module.graph.nodes]  # only the norms read it
    module.recompile()
    torch.testing.assert_close(module(x), want, rtol=2e-2, atol=2e-2)


def test_gemmas_norm_is_left_as_it_is():
    """Gemma's norm scales by 1 + weight, in float32: another form, which the kernels do not take."""
    norms, additions, ops, want, got, _ = _fused(Layer(norm=Gemma3RMSNorm), _x())
    assert norms == [] and len(additions) == 2
    assert ops.count("aten::rsqrt") == 2
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_a_product_read_twice_keeps_its_addition():
    norms, additions, ops, want, got, _ = _fused(Layer(reread_output=True), _x())
    assert len(norms) == 2 and len(additions) == 1  # the down projection's
    assert ops.count("aten::add") == 2  # the attention's q + k * v, and o's residual addition
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


class OtherNorms(torch.nn.Module):
    """Norm-like scalings that are not Llama's RMS norm: over another dimension, without keepdim's
    broadcast, and with a power other than 2."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, HIDDEN))
        self.scale = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        x32 = x.float()
        over_rows = x32 * torch.rsqrt(x32.pow(2).mean(0, keepdim=True) + EPS)
        no_keepdim = x32 * torch.rsqrt(x32.pow(2).mean(-1) + EPS)
        cubes = x32 * torch.rsqrt(x32.pow(3).mean(-1, keepdim=True) + EPS)
        return tuple(torch.ops.zerokv.matvec(self.scale.half() * y.half(), self.weight.half())
                     for y in (over_rows, no_keepdim, cubes))


def test_norms_of_other_forms_are_left():
    x = torch.rand(1, HIDDEN, dtype=torch.float16, device=DEVICE) + 0.5
    module = torch.export.export(OtherNorms().to(DEVICE), (x,)).run_decompositions({}).module()
    before = str(module.graph)
    assert fuse_rms_norms(module.graph, module) == []
    assert str(module.graph) == before
