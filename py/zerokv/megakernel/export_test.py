"""A transformers Llama model's decode step lowered to one MEGAKERNEL delegate: its blob, and the
caches' writes that zero-copy may and may not alias."""

import pytest
import torch

import zerokv.executorch as zx
from zerokv import blob
from zerokv.errors import ZeroKVError
from zerokv.executorch.delegates import delegate_nodes, parsed_blob
from zerokv.megakernel import export as megakernel_export
from zerokv.megakernel.llama_step import LAYER_WEIGHTS, MODEL_WEIGHTS, LlamaDecodeStep
from zerokv.megakernel.testing import small_model



@pytest.fixture(scope="module")
def model():
    return small_model()


def _blobs(manager):
    return [parsed_blob(lowered) for _, lowered in delegate_nodes(manager.exported_program("decode").graph_module)]


def test_the_step_is_one_megakernel_delegate_over_runtime_owned_caches(model):
    program, runtime_kv = megakernel_export.export_decode(model, max_capacity=128, initial_capacity=16)
    manager = zx.export({"decode": program}, engine="megakernel", runtime_kv=runtime_kv)
    (parsed,) = _blobs(manager)
    assert parsed.engine_kind == blob.EngineKind.MEGAKERNEL
    # The method takes the token and the position; the runtime binds the caches, written in place.
    method = manager.exported_program("decode")
    assert [node.name for node in method.graph.find_nodes(op="placeholder")] == ["input_ids", "cache_position"]
    caches = megakernel_export.cache_input_names(2)
    names = [binding.name for binding in parsed.metadata.bindings]
    assert names == ["input_ids", "cache_position", *caches, *(f"{cache}_out" for cache in caches), "getitem"]
    assert [(alias.output, alias.input) for alias in parsed.metadata.aliased_io] == [(f"{c}_out", c) for c in caches]
    assert [(layer.k_binding, layer.v_binding, layer.initial_capacity, layer.max_capacity)
            for layer in parsed.metadata.kv_layers] == [(caches[0], caches[1], 16, 128), (caches[2], caches[3], 16, 128)]
    assert parsed.metadata.positions_binding == "cache_position"
    constants = {constant.name: constant for constant in parsed.metadata.constants}
    assert list(constants) == [f"layers.{l}.{w}" for l in range(2) for w in LAYER_WEIGHTS] + list(MODEL_WEIGHTS)
    assert constants["layers.1.qkv"].sizes == [(8 + 2 * 2) * 64, 512]
    assert constants["inv_freq"].dtype == blob.DType.FLOAT32
    assert constants["embedding"].key == constants["lm_head"].key  # tied: one entry
    assert bytes(parsed.payload).decode() == "rms_eps 1e-06\nrope_attention_scaling 1.0\n"


def test_the_program_computes_the_step(model):
    program, _ = megakernel_export.export_decode(model, max_capacity=32)
    step = LlamaDecodeStep(model)
    ours = [torch.zeros(1, 2, 32, 64, dtype=torch.bfloat16) for _ in range(4)]
    theirs = [cache.clone() for cache in ours]
    with torch.no_grad():
        for position, token in enumerate((3, 99, 512)):
            inputs = (torch.tensor([[token]]), torch.tensor([position]))
            torch.testing.assert_close(program.module()(*inputs, *ours), step(*inputs, *theirs), atol=0, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_refuses_caller_owned_caches(model):
    program, _ = megakernel_export.export_decode(model, max_capacity=32)
    with pytest.raises(ZeroKVError, match=r"caches \['caches_0', .*\] are not written in place: .* declare them in runtime_kv"):
        zx.export({"decode": program}, engine="megakernel")


class _WritesPastItsRow(LlamaDecodeStep):
    def forward(self, input_ids, cache_position, *caches):
        logits, rows = torch.ops.zerokv.llama_decode_step(
            input_ids, cache_position, list(caches), [getattr(self, name) for name in self.weight_names],
            self.rms_eps, self.rope_attention_scaling)
        for index, cache in enumerate(caches):
            cache.index_copy_(2, cache_position + 1, rows[index])
        return logits


@pytest.mark.parametrize("engine", ["megakernel", "aoti"])
def test_a_write_the_step_may_read_is_not_aliased(model, engine, monkeypatch):
    # The step reads rows [0, position): a write at position + 1 is past them, but nothing proves
    # it, so no engine may write it in place.
    monkeypatch.setattr(megakernel_export, "LlamaDecodeStep", _WritesPastItsRow)
    program, runtime_kv = megakernel_export.export_decode(model, max_capacity=32)
    options = {"engine_options": {"compile_device": "cpu"}} if engine == "aoti" else {}
    with pytest.raises(ZeroKVError, match="runtime KV cache 'caches_0' must be written once by a KV write"):
        zx.export({"decode": program}, engine=engine, runtime_kv=runtime_kv, **options)


def test_refuses_an_initial_capacity_past_the_maximum(model):
    with pytest.raises(ZeroKVError, match=r"initial_capacity \(64\) <= max_capacity \(32\)"):
        megakernel_export.export_decode(model, max_capacity=32, initial_capacity=64)
