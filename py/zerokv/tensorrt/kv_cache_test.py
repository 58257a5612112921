"""KV cache writes lowered to TensorRT: each test builds a real plan (TensorRT-RTX on CPU).

Plans are built but not executed here (no supported GPU); the assertions read
the network that was built: its KV-cache-update and scatter layers, which
network input each writes, the outputs, the aliased pairs and the profiles.
"""

import pytest
import torch

from zerokv.tensorrt import (
    AliasingPromiseError,
    ConversionError,
    DynamicDim,
    build_network,
    decode_and_prefill_profiles,
    import_tensorrt,
    kv_write_alias_decline,
    lower_to_tensorrt,
)
from zerokv.kvwrite import exported_program_constants, is_kv_write
from zerokv.tensorrt.reference_evaluator import evaluate_network
from zerokv.tensorrt.testing_models import (
    MAX_SEQ,
    TinyDecoder,
    arange_plus_offset,
    export_decoder,
    offset_plus_arange,
    slice_assignment,
)

trt = import_tensorrt()
CACHES = ("layer.k_cache", "layer.v_cache")
ALIASED = {(f"{c}.updated", c, "kv_cache_update") for c in CACHES}


def alias_declines(program):
    """kv_write_alias_decline of each KV write of `program`, made functional as export makes it,
    by the name of the placeholder it writes."""
    program = program.run_decompositions({})
    constants = exported_program_constants(program)
    writes = [node for node in program.graph.nodes if is_kv_write(node)]
    return {write.args[0].name: kv_write_alias_decline(write, constants) for write in writes}


_LAYER_CLASSES = {
    trt.LayerType.KV_CACHE_UPDATE: trt.IKVCacheUpdateLayer,
    trt.LayerType.SCATTER: trt.IScatterLayer,
}


def typed(layer):
    """`get_layer` returns the ILayer base; the bindings downcast by class assignment."""
    if layer.type in _LAYER_CLASSES:
        layer.__class__ = _LAYER_CLASSES[layer.type]
    return layer


def layers_of(network, layer_type):
    layers = (typed(network.get_layer(i)) for i in range(network.num_layers))
    return [layer for layer in layers if layer.type == layer_type]


def producer_of(network, tensor_name):
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if any(layer.get_output(o).name == tensor_name for o in range(layer.num_outputs)):
            return typed(layer)
    raise AssertionError(f"no layer produces '{tensor_name}'")


def build_plan(built):
    """Builds the plan and checks it is a real one."""
    engine = built.build()
    assert isinstance(engine.serialized_plan, bytes) and len(engine.serialized_plan) > 10_000
    return engine


def assert_updated_in_place(built):
    """Both caches are written by one KV-cache-update layer each, aliased to their input."""
    network = built.network
    updates = layers_of(network, trt.LayerType.KV_CACHE_UPDATE)
    assert len(updates) == 2
    assert not layers_of(network, trt.LayerType.SCATTER)
    assert {a.as_tuple() for a in built.aliased_io} == ALIASED
    assert built.fallbacks == ()
    for cache in CACHES:
        layer = producer_of(network, f"{cache}.updated")
        assert layer.type == trt.LayerType.KV_CACHE_UPDATE
        assert layer.cache_mode == trt.KVCacheMode.LINEAR
        assert layer.get_input(0).is_network_input and layer.get_input(0).name == cache
        write_indices = layer.get_input(2)
        assert write_indices.dtype == trt.int32 and tuple(write_indices.shape) == (1,)
    return updates


def assert_written_by_scatter(built, reason_words):
    """Both caches fall back to a scatter that still writes them: nothing aliased, nothing dropped."""
    network = built.network
    assert not layers_of(network, trt.LayerType.KV_CACHE_UPDATE)
    assert len(layers_of(network, trt.LayerType.SCATTER)) == 2
    assert built.aliased_io == ()
    assert {f.target for f in built.fallbacks} == set(CACHES)
    for fallback in built.fallbacks:
        for word in reason_words:
            assert word in fallback.reason, fallback.reason
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    for cache in CACHES:
        assert f"{cache}.updated" in outputs
        scatter = producer_of(network, f"{cache}.updated")
        assert scatter.type == trt.LayerType.SCATTER
        assert scatter.mode == trt.ScatterMode.ELEMENT and scatter.axis == 2
        assert scatter.get_input(0).name == cache and scatter.get_input(0).is_network_input


def run_steps_against_eager(model, built, steps):
    """Runs `steps` of (input_ids, offset) through eager and the reference evaluator.

    Aliased caches are written in place by the evaluator, as by the engine; a
    fallback's written cache is copied back, as its caller must. After each step
    the logits and both caches must match eager's.
    """
    caches = {cache: torch.zeros(getattr(model.layer, cache.split(".")[1]).shape) for cache in CACHES}
    aliased_outputs = {a.output for a in built.aliased_io}
    for input_ids, offset in steps:
        outputs = evaluate_network(built.network, {"input_ids": input_ids, "offset": offset, **caches})
        with torch.no_grad():
            expected = model(input_ids, offset)
        torch.testing.assert_close(outputs["output_0"], expected, atol=1e-5, rtol=1e-5)
        for cache, value in caches.items():
            written = outputs[f"{cache}.updated"]
            if f"{cache}.updated" in aliased_outputs:
                assert written is value, "an aliased update must write the cache input itself"
            else:
                value.copy_(written)
            torch.testing.assert_close(value, getattr(model.layer, cache.split(".")[1]))


def test_single_token_decode_updates_the_caches_in_place():
    program = export_decoder(TinyDecoder(arange_plus_offset), length=1, offset=torch.tensor([7]))
    built = build_network(program)
    assert_updated_in_place(built)
    update = producer_of(built.network, "layer.k_cache.updated").get_input(1)
    assert tuple(update.shape) == (1, 2, 1, 16)
    engine = build_plan(built)
    assert engine.layer_type_counts["KV_CACHE_UPDATE"] == 2
    assert engine.profiles == ()


def test_static_multi_token_prefill_is_one_update_per_cache():
    program = export_decoder(TinyDecoder(arange_plus_offset), length=5, offset=torch.tensor([3]))
    built = build_network(program)
    assert_updated_in_place(built)
    assert tuple(producer_of(built.network, "layer.v_cache.updated").get_input(1).shape) == (1, 2, 5, 16)
    build_plan(built)
    run_steps_against_eager(
        TinyDecoder(arange_plus_offset), built, [(torch.randint(0, 64, (1, 5)), torch.tensor([3]))]
    )


def test_dynamic_multi_token_prefill_is_one_update_per_cache():
    program = export_decoder(
        TinyDecoder(arange_plus_offset), length=4, offset=torch.tensor([3]), dynamic_length=True
    )
    built = build_network(program)
    assert_updated_in_place(built)
    assert tuple(producer_of(built.network, "layer.k_cache.updated").get_input(1).shape) == (1, 2, -1, 16)
    (profile,) = built.profiles
    assert profile.name == "default" and profile.shapes["input_ids"] == ((1, 1), (1, 16), (1, 16))
    build_plan(built)


@pytest.mark.parametrize(
    "offset", [torch.tensor([5]), torch.tensor(5)], ids=["one_element_offset", "zero_dim_offset"]
)
@pytest.mark.parametrize("positions", [arange_plus_offset, offset_plus_arange], ids=["arange+offset", "offset+arange"])
def test_tensor_offsets_in_either_operand_order(positions, offset):
    program = export_decoder(TinyDecoder(positions), length=3, offset=offset, dynamic_length=True)
    built = build_network(program)
    assert_updated_in_place(built)
    offset_binding = next(b for b in built.io_bindings if b.name == "offset")
    assert offset_binding.shape == tuple(offset.shape) and offset_binding.role == "user_input"
    build_plan(built)
    steps = [(torch.randint(0, 64, (1, 4)), offset), (torch.randint(0, 64, (1, 1)), offset + 4)]
    run_steps_against_eager(TinyDecoder(positions), built, steps)


@pytest.mark.parametrize("positions", [
    lambda length, offset: torch.arange(length) + 6,
    lambda length, offset: 6 + torch.arange(length),
], ids=["arange+int", "int+arange"])
def test_python_int_offset_in_either_operand_order(positions):
    program = export_decoder(TinyDecoder(positions), length=3, offset=torch.tensor([0]))
    built = build_network(program)
    assert_updated_in_place(built)
    build_plan(built)


def test_constant_folded_index_still_updates_in_place():
    program = export_decoder(
        TinyDecoder(lambda length, offset: torch.arange(length) + 4), length=3, offset=torch.tensor([0])
    )
    built = build_network(program, fold_constants=True)
    assert_updated_in_place(built)
    build_plan(built)
    model = TinyDecoder(lambda length, offset: torch.arange(length) + 4)
    run_steps_against_eager(model, built, [(torch.randint(0, 64, (1, 3)), torch.tensor([0]))])


def test_constant_index_with_an_ascending_run_updates_in_place():
    program = export_decoder(
        TinyDecoder(lambda length, offset: torch.tensor([9, 10, 11])), length=3, offset=torch.tensor([0])
    )
    assert_updated_in_place(build_network(program))


def test_slice_assignment_updates_in_place():
    program = export_decoder(
        TinyDecoder(lambda length, offset: torch.arange(length) + 2, write=slice_assignment),
        length=3,
        offset=2,
    )
    built = build_network(program)
    assert_updated_in_place(built)
    build_plan(built)


def test_one_engine_serves_decode_and_prefill_profiles():
    program = export_decoder(
        TinyDecoder(arange_plus_offset, gemma_style=True),
        length=4,
        offset=torch.tensor([0]),
        dynamic_length=True,
        max_length=16,
    )
    built = build_network(program, decode_and_prefill_profiles("input_ids", 1, max_prefill=16))
    assert_updated_in_place(built)
    assert built.config.num_optimization_profiles == 2
    decode, prefill = built.profiles
    assert decode.name == "decode" and decode.shapes["input_ids"] == ((1, 1), (1, 1), (1, 1))
    assert prefill.name == "prefill" and prefill.shapes["input_ids"] == ((1, 1), (1, 16), (1, 16))
    bindings = {b.name: b for b in built.io_bindings}
    assert bindings["input_ids"].shape == (1, DynamicDim(1, 16))
    assert bindings["output_0"].shape[1] == DynamicDim(1, 16)
    for cache in CACHES:
        # The caches are static, so the alias holds in both profiles.
        assert bindings[cache].shape == (1, 2, MAX_SEQ, 16) and bindings[cache].role == "kv_cache"
        assert bindings[f"{cache}.updated"].shape == (1, 2, MAX_SEQ, 16)
    engine = build_plan(built)
    assert [p.name for p in engine.profiles] == ["decode", "prefill"]
    assert {a.as_tuple() for a in engine.aliased_io} == ALIASED
    run_steps_against_eager(
        TinyDecoder(arange_plus_offset, gemma_style=True),
        built,
        [
            (torch.randint(0, 64, (1, 6)), torch.tensor([0])),
            (torch.randint(0, 64, (1, 1)), torch.tensor([6])),
            (torch.randint(0, 64, (1, 1)), torch.tensor([7])),
        ],
    )


def test_promised_aliases_that_hold_are_accepted():
    program = export_decoder(TinyDecoder(arange_plus_offset), length=2, offset=torch.tensor([1]))
    assert alias_declines(program) == {"b_layer_k_cache": None, "b_layer_v_cache": None}
    engine = lower_to_tensorrt(program, promised_aliases=CACHES)
    assert {a.as_tuple() for a in engine.aliased_io} == ALIASED


# ----- Fallbacks: the write happens through a scatter ---------------------------


def test_scattered_constant_index_falls_back_to_a_scatter():
    program = export_decoder(
        TinyDecoder(lambda length, offset: torch.tensor([5, 1, 9])), length=3, offset=torch.tensor([0])
    )
    built = build_network(program)
    assert_written_by_scatter(built, ["(5, 1, 9)", "not an ascending run"])
    build_plan(built)
    model = TinyDecoder(lambda length, offset: torch.tensor([5, 1, 9]))
    run_steps_against_eager(model, built, [(torch.randint(0, 64, (1, 3)), torch.tensor([0]))])


def test_strided_positions_fall_back_to_a_scatter_with_dynamic_length():
    program = export_decoder(
        TinyDecoder(lambda length, offset: torch.arange(length) * 2 + offset),
        length=3,
        offset=torch.tensor([0]),
        dynamic_length=True,
        max_length=8,
    )
    built = build_network(program, decode_and_prefill_profiles("input_ids", 1, max_prefill=8))
    assert_written_by_scatter(built, ["not provably contiguous"])
    build_plan(built)
    model = TinyDecoder(lambda length, offset: torch.arange(length) * 2 + offset)
    run_steps_against_eager(
        model, built, [(torch.randint(0, 64, (1, 4)), torch.tensor([0])), (torch.randint(0, 64, (1, 1)), torch.tensor([9]))]
    )


def test_runtime_positions_fall_back_to_a_scatter():
    program = export_decoder(
        TinyDecoder(lambda length, offset: offset), length=3, offset=torch.tensor([4, 5, 6])
    )
    built = build_network(program)
    assert_written_by_scatter(built, ["runtime value"])
    build_plan(built)


class CallerOwnedCaches(torch.nn.Module):
    """Caches passed in by the caller (mutated user inputs) with a dynamic batch."""

    def __init__(self):
        super().__init__()
        self.k_proj = torch.nn.Linear(32, 32, bias=False)
        self.v_proj = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x, offset, k_cache, v_cache):
        batch, length, _ = x.shape
        positions = torch.arange(length) + offset
        k_cache.index_copy_(2, positions, self.k_proj(x).view(batch, length, 2, 16).transpose(1, 2))
        v_cache.index_copy_(2, positions, self.v_proj(x).view(batch, length, 2, 16).transpose(1, 2))
        return k_cache.sum() + v_cache.sum()


def test_dynamic_batch_declines_the_layer_and_scatters():
    batch = torch.export.Dim("batch", min=1, max=4)
    length = torch.export.Dim("length", min=1, max=8)
    caches = {0: batch}
    program = torch.export.export(
        CallerOwnedCaches().eval(),
        (torch.randn(2, 3, 32), torch.tensor([0]), torch.zeros(2, 2, MAX_SEQ, 16), torch.zeros(2, 2, MAX_SEQ, 16)),
        dynamic_shapes=({0: batch, 1: length}, None, caches, caches),
    )
    built = build_network(program)
    network = built.network
    assert not layers_of(network, trt.LayerType.KV_CACHE_UPDATE)
    assert len(layers_of(network, trt.LayerType.SCATTER)) == 2
    assert built.aliased_io == ()
    for cache in ("k_cache", "v_cache"):
        (fallback,) = [f for f in built.fallbacks if f.target == cache]
        assert "batch is not static" in fallback.reason
        scatter = producer_of(network, f"{cache}.updated")
        assert scatter.type == trt.LayerType.SCATTER and scatter.get_input(0).name == cache
    bindings = {b.name: b for b in built.io_bindings}
    assert bindings["k_cache"].role == "kv_cache" and bindings["k_cache"].shape[0] == DynamicDim(1, 4)
    assert "dynamic extent on axis 0" in alias_declines(program)["k_cache"]
    with pytest.raises(AliasingPromiseError, match="cache 'v_cache' was promised.*batch is not static"):
        build_network(program, promised_aliases=["v_cache"])
    build_plan(built)


def test_a_cache_written_twice_scatters_both_writes():
    def positions(length, offset):
        return torch.arange(length) + offset

    def write_twice(cache, positions, update, offset):
        cache.index_copy_(2, positions, update)
        cache.index_copy_(2, positions + 8, update)

    program = export_decoder(TinyDecoder(positions, write=write_twice), length=2, offset=torch.tensor([0]))
    built = build_network(program)
    assert not layers_of(built.network, trt.LayerType.KV_CACHE_UPDATE)
    assert len(layers_of(built.network, trt.LayerType.SCATTER)) == 4
    reasons = " | ".join(f.reason for f in built.fallbacks)
    assert "is not the value written back" in reasons and "not a caller-owned network input" in reasons
    assert built.aliased_io == ()
    build_plan(built)
    run_steps_against_eager(
        TinyDecoder(positions, write=write_twice), built, [(torch.randint(0, 64, (1, 2)), torch.tensor([0]))]
    )


def test_an_index_put_write_is_refused_naming_it():
    def index_put(cache, positions, update, offset):
        cache[:, :, positions] = update

    program = export_decoder(TinyDecoder(arange_plus_offset, write=index_put), length=2, offset=torch.tensor([0]))
    with pytest.raises(ConversionError, match=r"node 'index_put' .*: the KV write cannot be lowered: .*index tuple"):
        build_network(program)


def test_promised_alias_that_falls_back_fails_loudly():
    program = export_decoder(
        TinyDecoder(lambda length, offset: torch.tensor([5, 1, 9])), length=3, offset=torch.tensor([0])
    )
    assert "not an ascending run" in alias_declines(program)["b_layer_k_cache"]
    with pytest.raises(AliasingPromiseError, match=r"cache 'layer.k_cache' was promised.*\(5, 1, 9\)"):
        build_network(program, promised_aliases=["layer.k_cache"])
