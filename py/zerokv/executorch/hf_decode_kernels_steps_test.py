"""A Hugging Face decoder switched to zerokv's decode kernels (split-K decode attention, one-token
linear layers) decodes as eager does, step by step over caches longer than what is committed, and
across a growth of their capacity: run as it is, and as the decode method zerokv exports
(hf_decoders.export_programs: one program, its capacity dynamic). Under Triton's interpreter
(TRITON_INTERPRET=1, as the Bazel target sets it: it must be set before Triton is imported) on the
CPU in float16; without it, on a CUDA machine, compiled in bfloat16."""

import os

import pytest
import torch

from zerokv.executorch import hf_decoders as hf
from zerokv.executorch.hf_decode_attention import use_splitk_decode
from zerokv.executorch.hf_decode_linear import use_matvec_decode

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip("no CUDA device: run under Triton's interpreter, TRITON_INTERPRET=1", allow_module_level=True)

DEVICE, DTYPE = ("cpu", torch.float16) if INTERPRET else ("cuda", torch.bfloat16)
STEPS = 12


VIEWS = {torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default,
         torch.ops.aten.view.default, torch.ops.aten.squeeze.dim, torch.ops.aten.alias.default}


def _through_views(node):
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


@pytest.mark.parametrize("exported", [False, True], ids=["eager", "exported"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_steps_match_eager_across_a_growth(family, exported):
    reference = hf.tiny(family).to(DEVICE, DTYPE)
    want, tokens = hf.eager_steps(reference, torch.tensor([[1]], device=DEVICE), STEPS)
    model = hf.tiny(family).to(DEVICE, DTYPE)
    use_splitk_decode(model)
    switched = use_matvec_decode(model)
    if exported:
        programs, _ = hf.export_programs(model, max_capacity=16, max_prefill=1, initial_capacity=8, prefill=False)
        targets = [node.target for node in programs["decode"].graph.nodes]
        assert targets.count(torch.ops.zerokv.flash_decode.default) == model.config.num_hidden_layers
        assert targets.count(torch.ops.zerokv.gated_matvec.default) == switched.gated_mlps == model.config.num_hidden_layers
        # Gate and up are read by the MLPs' gated product, not on their own.
        assert targets.count(torch.ops.zerokv.matvec.default) == switched.linear_layers - 2 * switched.gated_mlps
        # Each layer's kernel reads the step's position from the cache_position input, through views.
        sources = {_through_views(node.args[3]).name for node in programs["decode"].graph.nodes
                   if node.target == torch.ops.zerokv.flash_decode.default}
        assert sources == {"cache_position"}
        step = programs["decode"].module()
    else:
        step = hf.CacheInputs(model)
    # Poison past the committed positions: a read there would show. The capacity doubles halfway,
    # as a runtime-owned cache grows, with the committed rows carried over.
    caches = [torch.full(hf.cache_shape(model.config, 8), float("nan"), device=DEVICE, dtype=DTYPE)
              for _ in hf.cache_input_names(model.config)]
    fed = [1, *tokens[:-1]]
    with torch.no_grad():
        for position, token in enumerate(fed):
            if position == 8:
                grown = [torch.full(hf.cache_shape(model.config, 16), float("nan"), device=DEVICE, dtype=DTYPE)
                         for _ in caches]
                for old, new in zip(caches, grown):
                    new[:, :, :8] = old
                caches = grown
            got = step(torch.tensor([[token]], device=DEVICE), torch.tensor([position], device=DEVICE), *caches)[0]
            cosine = torch.nn.functional.cosine_similarity(got.float(), want[position].float(), dim=-1)
            assert cosine.item() > 0.999, f"position {position}: cosine {cosine.item()}"
            assert got.argmax().item() == want[position].argmax().item(), f"position {position}: top-1 differs"
