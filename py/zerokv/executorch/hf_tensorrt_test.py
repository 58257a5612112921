"""Hugging Face decoders exported with transformers' ExecuTorch integration (static cache in buffers),
through the TensorRT engine (real TensorRT-RTX plans, built on the CPU; nothing runs them here): each
method, the dynamic-length prefill included, is one delegate that updates every layer's K and V cache
in place."""

import pytest
import torch
from executorch.exir.delegate import executorch_call_delegate

import zerokv.executorch as zx
from zerokv import blob
from zerokv.executorch import hf_decoders as hf
from zerokv.executorch.zero_copy import delegate_nodes
from zerokv.tensorrt.lowering import lower_to_tensorrt
from zerokv.tensorrt.network import ConversionError


def _static(family):
    model = hf.tiny(family)
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": hf.MAX_CACHE_LEN}
    return model


@pytest.mark.parametrize("method", ["decode", "prefill"])
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_each_method_is_one_delegate_updating_every_cache_in_place(family, method):
    model = _static(family)
    program = (hf.export_decode if method == "decode" else hf.export_prefill)(model)
    manager = zx.export({method: program}, engine="tensorrt")
    graph_module = manager.exported_program(method).graph_module
    delegates = list(delegate_nodes(graph_module))
    assert len(delegates) == 1, [node.name for node, _ in delegates]
    ((_, lowered),) = delegates
    parsed = blob.parse(lowered.processed_bytes)
    assert parsed.aliased_outputs_elided
    caches = {f"{kind}_cache_{layer}" for kind in ("key", "value") for layer in range(model.config.num_hidden_layers)}
    aliased = {alias.input for alias in parsed.metadata.aliased_io}
    assert {name for name in aliased if "_cache_" in name} == {f"b_{name}" for name in caches} or caches <= {
        name.removeprefix("b_") for name in aliased}, aliased


def test_a_symbolic_size_output_is_a_clear_error():
    # A partition that ends in a size another (unconverted) op uses must be refused by name.
    class Width(torch.nn.Module):
        def forward(self, x):
            return x.shape[1]

    width = torch.export.Dim("width", min=2, max=8)
    program = torch.export.export(Width(), (torch.zeros(1, 4),), dynamic_shapes=({1: width},))
    with pytest.raises(ConversionError, match="sym_size.*symbolic size"):
        lower_to_tensorrt(program, ())
