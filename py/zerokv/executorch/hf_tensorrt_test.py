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


def _static(family, sliding_window=hf.MAX_CACHE_LEN):
    # A window as long as the cache: transformers' static sliding layers never roll over.
    model = hf.tiny(family, sliding_window=sliding_window)
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
    assert {(alias.input, alias.kind) for alias in parsed.metadata.aliased_io} == {
        (f"b_{name}", blob.AliasKind.KV_CACHE_UPDATE) for name in caches}
    # Outside the delegate: only the copies of the method's inputs and outputs (and of transformers'
    # cumulative_length counters, which are not caches).
    outside = {str(node.target) if isinstance(node.target, torch._ops.OpOverload) else node.target.__name__
               for node in graph_module.graph.nodes
               if node.op == "call_function" and node.target is not executorch_call_delegate}
    assert outside <= {"alloc", "getitem", "et_copy._h2d_copy.out", "et_copy._d2h_copy.out", "aten.copy_.default"}, \
        outside


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
