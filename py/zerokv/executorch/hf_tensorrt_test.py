"""Hugging Face decoders exported with transformers' ExecuTorch integration (static cache in buffers),
through the TensorRT engine (real TensorRT-RTX plans, built on the CPU; nothing runs them here): each
method, the dynamic-length prefill included, is one delegate that updates every layer's K and V cache
in place, in every optimization profile of its plan, and nothing else of the model runs on the host."""

import operator

import pytest
import torch
from executorch.exir import memory
from executorch.exir.delegate import executorch_call_delegate
from torch.export.graph_signature import OutputKind

import zerokv.executorch as zx
from zerokv import blob
from zerokv.executorch import hf_decoders as hf
from zerokv.executorch import tensorrt_engine
from zerokv.executorch.zero_copy import delegate_nodes
from zerokv.tensorrt.lowering import lower_to_tensorrt
from zerokv.tensorrt.network import ConversionError
from zerokv.tensorrt.profiles import DimRange, Profile

H2D = torch.ops.et_copy._h2d_copy.out
D2H = torch.ops.et_copy._d2h_copy.out


def _static(family, sliding_window=hf.MAX_CACHE_LEN):
    # A window as long as the cache: transformers' static sliding layers never roll over.
    model = hf.tiny(family, sliding_window=sliding_window)
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": hf.MAX_CACHE_LEN}
    return model


def _caches(model):
    return {f"{kind}_cache_{layer}" for kind in ("key", "value") for layer in range(model.config.num_hidden_layers)}


def _host_work(exported_program):
    """The nodes of a finalized method that run outside its delegates, less the staging of the method's
    own inputs (allocated, copied to the device) and outputs (copied back to the host): a copy-back of
    a buffer, a buffer's staging copy, any op left on the host."""
    user_inputs = set(exported_program.graph_signature.user_inputs)
    output = exported_program.graph.output_node()
    left = []
    for node in exported_program.graph.nodes:
        if node.op != "call_function" or node.target in (executorch_call_delegate, operator.getitem, memory.alloc):
            continue
        if node.target is H2D and node.args[0].op == "placeholder" and node.args[0].name in user_inputs:
            continue
        if node.target is D2H and list(node.users) == [output]:
            continue
        left.append(f"{node.name} ({node.target})")
    return left


@pytest.mark.parametrize("method", ["decode", "prefill"])
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_each_method_is_one_delegate_updating_every_cache_in_place(family, method):
    model = _static(family)
    program = (hf.export_decode if method == "decode" else hf.export_prefill)(model)
    manager = zx.export({method: program}, engine="tensorrt")
    exported_program = manager.exported_program(method)
    delegates = list(delegate_nodes(exported_program.graph_module))
    assert len(delegates) == 1, [node.name for node, _ in delegates]
    ((_, lowered),) = delegates
    parsed = blob.parse(lowered.processed_bytes)
    assert parsed.aliased_outputs_elided
    assert {(alias.input, alias.kind) for alias in parsed.metadata.aliased_io} == {
        (f"b_{name}", blob.AliasKind.KV_CACHE_UPDATE) for name in _caches(model)}
    # The only state the method keeps is its caches (written in place by the delegate), and the host
    # does nothing but hand the delegate the token and positions and take the logits back.
    mutated = {spec.target for spec in exported_program.graph_signature.output_specs
               if spec.kind == OutputKind.BUFFER_MUTATION}
    assert mutated == _caches(model)
    assert _host_work(exported_program) == []


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_every_cache_is_aliased_in_every_profile_of_a_prefill_plan(family, monkeypatch):
    # Two profiles over the prefill's dynamic length (2..16 in the export): one plan serves both. The
    # blob does not record profiles and the plan cannot be deserialized without a GPU, so the engine
    # the export built is read where it is built.
    built = []

    def recording_lowering(*args, **kwargs):
        built.append(lower_to_tensorrt(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(tensorrt_engine, "lower_to_tensorrt", recording_lowering)
    model = _static(family)
    tokens = ("input_ids", 1)
    profiles = [Profile("short", {tokens: DimRange(2, 4, 8)}), Profile("long", {tokens: DimRange(8, 16, 16)})]
    manager = zx.export({"prefill": hf.export_prefill(model)}, engine="tensorrt",
                        engine_options={"profiles": profiles})

    ((_, lowered),) = delegate_nodes(manager.exported_program("prefill").graph_module)
    parsed = blob.parse(lowered.processed_bytes)
    (engine,) = built
    caches = {f"b_{name}" for name in _caches(model)}
    assert [profile.name for profile in engine.profiles] == ["short", "long"]
    assert [profile.shapes["input_ids"] for profile in engine.profiles] == [
        ((1, 2), (1, 4), (1, 8)), ((1, 8), (1, 16), (1, 16))]
    # TensorRT aliases a KV-cache-update layer's output to its cache for the whole plan, provided the
    # cache is static: a static input has its one shape in every profile, where a dynamic one would
    # be listed in each profile's shapes.
    assert {(alias.input, alias.output) for alias in engine.aliased_io} == {
        (alias.input, alias.output) for alias in parsed.metadata.aliased_io}
    assert {alias.input for alias in parsed.metadata.aliased_io} == caches
    cache_shape = hf.cache_shape(model.config, hf.MAX_CACHE_LEN)
    for profile in engine.profiles:
        assert caches.isdisjoint(profile.shapes), profile
    for binding in parsed.metadata.bindings:
        if binding.name in caches:
            assert [(d.min, d.max) for d in binding.shape] == [(extent, extent) for extent in cache_shape]
    assert _host_work(manager.exported_program("prefill")) == []


def test_sliding_layers_that_would_roll_over_are_refused_by_name():
    with pytest.raises(zx.ZeroKVError, match=r"gemma3_text layers \[0, 1, 2\].*sliding-window"):
        hf.export_decode(_static("gemma3", sliding_window=4))


def test_a_symbolic_size_output_is_a_clear_error():
    # A partition that ends in a size another (unconverted) op uses must be refused by name.
    class Width(torch.nn.Module):
        def forward(self, x):
            return x.shape[1]

    width = torch.export.Dim("width", min=2, max=8)
    program = torch.export.export(Width(), (torch.zeros(1, 4),), dynamic_shapes=({1: width},))
    with pytest.raises(ConversionError, match="sym_size.*symbolic size"):
        lower_to_tensorrt(program, ())
