"""One-token linear layers: which products take zerokv::matvec, which keep torch's linear, and what is
refused. On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, which the Bazel
target sets). A switched decoder's steps are checked against eager by hf_decode_kernels_steps_test."""

import pytest
import torch

from zerokv.executorch import hf_decoders as hf
from zerokv.executorch.hf_decode_linear import (DecodeLinearError, GatedMatvecMLP, MatvecLinear, is_gated_silu_mlp,
                                                use_matvec_decode)
from zerokv.kernels.constant_weights import mark_constant_weights
from zerokv.kernels.sibling_matvecs import group_sibling_matvecs


def _switched(family="llama"):
    model = hf.tiny(family).to(torch.float16)
    return model, use_matvec_decode(model)


def test_every_linear_layer_and_gated_mlp_is_switched():
    model, switched = _switched()
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert switched.linear_layers == len(linears) == 7 * model.config.num_hidden_layers + 1
    assert all(type(module) is MatvecLinear for module in linears)
    assert switched.gated_mlps == model.config.num_hidden_layers
    assert all(isinstance(layer.mlp, GatedMatvecMLP) for layer in model.model.layers)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_gated_mlp_computes_what_it_did(family):
    torch.manual_seed(0)
    model = hf.tiny(family).to(torch.float16)
    mlp = model.model.layers[0].mlp
    x = {rows: torch.randn(1, rows, mlp.gate_proj.in_features, dtype=torch.float16) for rows in (1, 3)}
    with torch.no_grad():
        want = {rows: mlp.float()(value.float()) for rows, value in x.items()}
    model.half()
    use_matvec_decode(model)
    for rows, value in x.items():
        torch.testing.assert_close(mlp(value).float(), want[rows], rtol=2e-2, atol=2e-2)


def test_only_a_gated_silu_mlp_is_fused():
    mlp = hf.tiny("llama").model.layers[0].mlp
    assert is_gated_silu_mlp(mlp)
    mlp.act_fn = torch.nn.GELU()
    assert not is_gated_silu_mlp(mlp)
    assert not is_gated_silu_mlp(hf.tiny("llama").model.layers[0].self_attn)


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_takes_the_kernel_and_several_keep_linear(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 24, bias=bias, dtype=torch.float16)
    layer.__class__ = MatvecLinear
    for rows in (1, 3):
        x = torch.randn(1, rows, 64, dtype=torch.float16)
        want = torch.nn.functional.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=2e-2)
    ops = [node.target for node in torch.export.export(layer, (torch.randn(1, 1, 64, dtype=torch.float16),)).graph.nodes]
    assert torch.ops.zerokv.matvec.default in ops


def test_the_decode_program_takes_the_kernel_and_prefill_keeps_linear():
    model, switched = _switched()
    programs, _ = hf.export_programs(model, max_capacity=16, max_prefill=4, initial_capacity=8)
    counts = {name: [node.target for node in program.graph.nodes].count(torch.ops.zerokv.matvec.default)
              for name, program in programs.items()}
    assert counts == {"prefill": 0, "decode": switched.linear_layers - 2 * switched.gated_mlps}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_each_layers_query_key_and_value_become_one_launch_of_constant_weights(family):
    """What the AOTInductor engine compiles (zerokv.aoti.compile_aoti groups the calls and marks
    them): the same step, the attention's three projections in one launch per layer, and every
    product's weights the program's constants."""
    model = hf.tiny(family).to(torch.float16)
    use_matvec_decode(model)
    programs, _ = hf.export_programs(model, max_capacity=16, max_prefill=1, initial_capacity=8, prefill=False)
    step = programs["decode"].module()
    caches = [torch.randn(hf.cache_shape(model.config, 8), dtype=torch.float16) for _ in hf.cache_input_names(model.config)]
    grouped_caches = [cache.clone() for cache in caches]
    inputs = (torch.tensor([[3]]), torch.tensor([5]))
    want = step(*inputs, *caches)
    groups = group_sibling_matvecs(step.graph)
    marked = mark_constant_weights(step.graph)
    step.recompile()
    assert [len(group) for group in groups] == [3] * model.config.num_hidden_layers
    products = [node.name for node in step.graph.nodes if node.op == "call_function" and "zerokv" in str(node.target)
                and "flash_decode" not in str(node.target)]
    assert marked == products and len(products) == 4 * model.config.num_hidden_layers + 1
    got = step(*inputs, *grouped_caches)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(grouped_caches, caches))


def test_a_model_the_kernel_cannot_take_is_refused_by_name():
    model = hf.tiny("llama").to(torch.float64)
    with pytest.raises(DecodeLinearError, match="llama: one-token linear layers: the model is torch.float64"):
        use_matvec_decode(model)
    assert not any(isinstance(module, MatvecLinear) for module in model.modules())
