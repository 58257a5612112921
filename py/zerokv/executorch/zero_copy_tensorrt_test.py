"""Zero-copy KV export on real ExecuTorch programs with TensorRT delegates (TensorRT-RTX plans,
built on the CPU). These assert on the finalized programs; execution is tested with the AOTInductor
engine kind (zero_copy_aoti_test.py)."""

import logging
import operator

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig
from executorch.exir import schema as et_schema
from executorch.exir.delegate import executorch_call_delegate
from executorch.exir.tensor import TensorSpec
from torch.export.graph_signature import OutputKind

import zerokv.executorch as zx
from zerokv import blob
from zerokv.executorch.delegates import delegate_nodes, parsed_blob
from zerokv.tensorrt import decode_and_prefill_profiles
from zerokv.tensorrt import testing_models as tm

H2D = torch.ops.et_copy._h2d_copy.out
CACHE_SHAPE = (1, tm.HEADS, tm.MAX_SEQ, tm.HEAD_DIM)


def _decoder_program(positions=tm.arange_plus_offset, length=1):
    return tm.export_decoder(tm.TinyDecoder(positions), length, torch.tensor([3]))


class DecoderWithConvState(torch.nn.Module):
    """A decoder step beside a non-KV mutable buffer (a ring-shifted conv state)."""

    def __init__(self):
        super().__init__()
        self.decoder = tm.TinyDecoder(tm.arange_plus_offset)
        self.register_buffer("conv_state", torch.zeros(1, 4, tm.VOCAB))

    def forward(self, input_ids, offset):
        logits = self.decoder(input_ids, offset)
        shifted = torch.cat([self.conv_state[:, 1:], logits[:, -1:]], dim=1)
        self.conv_state.copy_(shifted)
        return logits + shifted.sum(dim=1, keepdim=True)


def _graph(manager, method="forward"):
    return manager.exported_program(method).graph_module.graph


def _placeholder(graph, buffer):
    return next(n for n in graph.find_nodes(op="placeholder") if n.target == "b_" + buffer.replace(".", "_"))


def _zero_copy_delegates(manager, method="forward"):
    found = []
    for node, lowered in delegate_nodes(manager.exported_program(method).graph_module):
        if lowered.backend_id == zx.BACKEND_ID:
            found.append((node, blob.parse(lowered.processed_bytes)))
    return found


def _assert_caches_zero_copy(manager, method="forward", caches=("layer.k_cache", "layer.v_cache")):
    graph = _graph(manager, method)
    signature = manager.exported_program(method).graph_signature
    plan = next(p for p in manager.executorch_program.execution_plan if p.name == method)
    cuda_buffers = {e.buffer_idx for e in plan.non_const_buffer_device if e.device_type == et_schema.DeviceType.CUDA}
    for cache in caches:
        node = _placeholder(graph, cache)
        assert not any(user.target is H2D for user in node.users), f"{cache} is still staged"
        assert any(user.target is executorch_call_delegate for user in node.users), f"{cache} reaches no delegate"
        assert node.meta["spec"].device == et_schema.DeviceType.CUDA
        assert node.meta["spec"].mem_id in cuda_buffers, f"{cache} is not planned in a CUDA arena"
        assert not any(user.target is torch.ops.aten.copy_.default for user in node.users), f"{cache} is copied back"
        mutation = [s for s in signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION and s.target == cache]
        assert [s.arg.name for s in mutation] == [node.name], "the mutation spec must point at the placeholder"


def test_decode_step_writes_caches_in_place():
    manager = zx.export(_decoder_program(), engine="tensorrt")
    _assert_caches_zero_copy(manager)
    ((node, parsed),) = _zero_copy_delegates(manager)
    assert parsed.engine_kind == blob.EngineKind.TENSORRT
    assert parsed.aliased_outputs_elided
    assert {(a.input, a.kind) for a in parsed.metadata.aliased_io} == {
        ("b_layer_k_cache", blob.AliasKind.KV_CACHE_UPDATE),
        ("b_layer_v_cache", blob.AliasKind.KV_CACHE_UPDATE),
    }
    # The recorded elision and the delegate's arity agree: inputs, then the one logits output.
    signature = blob.delegate_signature(parsed.metadata, parsed.aliased_outputs_elided)
    assert len(node.args) - 1 == len(signature.inputs)
    assert len([u for u in node.users if u.target is operator.getitem]) == len(signature.outputs) == 1


def test_opt_out_is_plain_executorch():
    manager = zx.export(_decoder_program(), engine="tensorrt", zero_copy_kv=False)
    graph = _graph(manager)
    for cache in ("layer.k_cache", "layer.v_cache"):
        node = _placeholder(graph, cache)
        assert any(user.target is H2D for user in node.users), f"{cache} should be staged"
        assert any(user.target is torch.ops.aten.copy_.default for user in node.users), f"{cache} needs a copy-back"
    ((_, parsed),) = _zero_copy_delegates(manager)
    assert not parsed.aliased_outputs_elided
    with pytest.raises(zx.ZeroCopyError, match="no method"):
        zx.check_zero_copy_kv(manager)


def test_conv_state_keeps_its_copy_back_and_the_mutation_map_stays_paired():
    with torch.no_grad():
        program = torch.export.export(
            DecoderWithConvState().eval(), (torch.randint(0, tm.VOCAB, (1, 1)), torch.tensor([3])))
    manager = zx.export(program, engine="tensorrt")
    _assert_caches_zero_copy(manager, caches=("decoder.layer.k_cache", "decoder.layer.v_cache"))
    graph = _graph(manager)
    conv = _placeholder(graph, "conv_state")
    copies = [user for user in conv.users if user.target is torch.ops.aten.copy_.default]
    assert len(copies) == 1, "conv_state must keep its write-back"
    # Each mutated buffer is paired with what writes it: a zero-copy cache with its own placeholder,
    # conv_state with its copy-back (a crossed map would pair a cache with the copy, see upstream.md).
    mutations = {
        spec.target: spec.arg.name
        for spec in manager.exported_program().graph_signature.output_specs
        if spec.kind == OutputKind.BUFFER_MUTATION
    }
    assert mutations == {
        "conv_state": mutations["conv_state"],
        "decoder.layer.k_cache": "b_decoder_layer_k_cache",
        "decoder.layer.v_cache": "b_decoder_layer_v_cache",
    }
    assert mutations["conv_state"].startswith("copy_")


def test_scattered_write_keeps_its_copy_back_visibly(caplog):
    scattered = lambda length, offset: torch.tensor([5, 1, 9])[:length] + offset * 0  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="zerokv.executorch.api"):
        with pytest.raises(zx.ZeroCopyError, match="no method"):
            zx.export(_decoder_program(scattered), engine="tensorrt")
    assert "keeps the copy-back of buffer 'layer.k_cache'" in caplog.text


class DecoderWithRankThreeCache(torch.nn.Module):
    """A decoder step beside a contiguous write into a rank-3 buffer: provably contiguous, but not
    a [batch, heads, positions, head_dim] cache, which TensorRT's KV cache update layer needs."""

    def __init__(self):
        super().__init__()
        self.decoder = tm.TinyDecoder(tm.arange_plus_offset)
        self.register_buffer("logit_history", torch.zeros(1, tm.VOCAB, tm.MAX_SEQ))

    def forward(self, input_ids, offset):
        logits = self.decoder(input_ids, offset)
        positions = torch.arange(input_ids.shape[1]) + offset
        self.logit_history.index_copy_(2, positions, logits.transpose(1, 2))
        return logits + self.logit_history.sum(2)[:, None, :]


def test_a_write_the_update_layer_cannot_take_keeps_its_copy_back(caplog):
    with torch.no_grad():
        program = torch.export.export(DecoderWithRankThreeCache().eval(), (torch.tensor([[1]]), torch.tensor([3])))
    with caplog.at_level(logging.WARNING, logger="zerokv.executorch.api"):
        manager = zx.export(program, engine="tensorrt")
    assert "keeps the copy-back of buffer 'logit_history': " in caplog.text and "must both be rank 4" in caplog.text
    _assert_caches_zero_copy(manager, caches=("decoder.layer.k_cache", "decoder.layer.v_cache"))


def test_host_memory_planning_is_refused():
    config = ExecutorchBackendConfig(enable_non_cpu_memory_planning=False)
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': buffer 'layer\.k_cache'.*enable_non_cpu_memory_planning"):
        zx.export(_decoder_program(), engine="tensorrt", backend_config=config)


class WriteOnly(torch.nn.Module):
    """Writes the cache and never reads it: with the copy-back gone, the write would be dead."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(CACHE_SHAPE))

    def forward(self, update, offset):
        self.k_cache.index_copy_(2, torch.arange(1) + offset, update)
        return update * 2


def test_an_engine_whose_every_output_would_be_elided_is_refused():
    program = torch.export.export(WriteOnly(), (torch.ones(1, tm.HEADS, 1, tm.HEAD_DIM), torch.tensor([2])))
    with pytest.raises(zx.ZeroCopyError, match="method 'forward': nothing reads the write of buffer 'k_cache'"):
        zx.export(program, engine="tensorrt")


def test_callers_to_out_var_pass_still_runs():
    calls = []
    base = ExecutorchBackendConfig()
    inner = base.to_out_var_pass

    def counting(graph_module):
        calls.append(graph_module)
        return inner(graph_module)

    base.to_out_var_pass = counting
    manager = zx.export(_decoder_program(), engine="tensorrt", backend_config=base)
    assert len(calls) == 1
    _assert_caches_zero_copy(manager)


def test_buffer_caches_of_prefill_and_decode_are_refused_not_silently_duplicated():
    # Each ExecuTorch method would get its own copy of the caches: decode would never see prefill's.
    model = tm.TinyDecoder(tm.arange_plus_offset)
    programs = {
        "prefill": tm.export_decoder(model, 4, torch.tensor([0])),
        "decode": tm.export_decoder(model, 1, torch.tensor([4])),
    }
    with pytest.raises(zx.ZeroCopyError, match=r"buffers \['layer.k_cache', 'layer.v_cache'\] are written by method "
                                               r"'prefill' and used by \['decode'\].*runtime_kv"):
        zx.export(programs, engine="tensorrt")


def test_save_writes_a_checked_program(tmp_path):
    manager = zx.export(_decoder_program(), engine="tensorrt")
    path = tmp_path / "decode.pte"
    assert zx.save(manager, str(path)) == [str(path), zx.data_path(str(path))]
    assert path.read_bytes() == manager.buffer
    # The plan is named data, in the .ptd beside the .pte: the blob holds only its key.
    (_, lowered), = delegate_nodes(manager.exported_program("forward").graph_module)
    parsed = parsed_blob(lowered)
    assert parsed.payload == b"" and parsed.metadata.engine_key.startswith("zerokv/")
    assert len(lowered.processed_bytes) < 4096
    assert (tmp_path / "decode.ptd").stat().st_size > 10_000


class DecoderThenClampThenProjection(torch.nn.Module):
    """Clamp has no TensorRT converter, so the method holds a zerokv delegate with the caches, an
    XNNPACK delegate for the clamp, and a second zerokv delegate (the projection) with no cache."""

    def __init__(self):
        super().__init__()
        self.decoder = tm.TinyDecoder(tm.arange_plus_offset)
        self.projection = torch.nn.Linear(tm.VOCAB, tm.VOCAB)

    def forward(self, input_ids, offset):
        return self.projection(torch.clamp(self.decoder(input_ids, offset), -1.0, 1.0))


def test_only_the_delegate_that_writes_the_caches_is_aliased_beside_another_backend():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    with torch.no_grad():
        program = torch.export.export(DecoderThenClampThenProjection().eval(), (torch.tensor([[1]]), torch.tensor([0])))
    manager = zx.export(program, engine="tensorrt", other_partitioners=[XnnpackPartitioner()])
    graph_module = manager.exported_program().graph_module
    backends = [lowered.backend_id for _, lowered in delegate_nodes(graph_module)]
    assert backends.count(zx.BACKEND_ID) == 2 and "XnnpackBackend" in backends, backends
    aliased, plain = sorted(_zero_copy_delegates(manager), key=lambda d: not d[1].aliased_outputs_elided)
    assert len(aliased[1].metadata.aliased_io) == 2
    assert not plain[1].aliased_outputs_elided and not plain[1].metadata.aliased_io
    # The projection's input is staged as usual: only promised in-place writes are un-staged.
    assert all(arg.target is H2D for arg in plain[0].args[1:])
    _assert_caches_zero_copy(manager, caches=("decoder.layer.k_cache", "decoder.layer.v_cache"))


class _ReadCacheOnHost:
    """A caller pass that makes a host op read the cache, as another backend's staging would."""

    def __call__(self, graph_module):
        from torch.fx.passes.infra.pass_base import PassResult

        graph = graph_module.graph
        cache = next(n for n in graph.find_nodes(op="placeholder") if n.name == "b_layer_k_cache")
        output = graph.output_node()
        *state, logits = output.args[0]
        with graph.inserting_before(output):
            total = graph.call_function(torch.ops.aten.sum.default, (cache,))
            logits = graph.call_function(torch.ops.aten.add.Tensor, (logits, total))
        logits.meta["val"] = output.args[0][-1].meta["val"]
        output.args = ((*state, logits),)
        graph_module.recompile()
        return PassResult(graph_module, True)


def test_a_cache_that_something_else_still_reads_is_refused():
    config = ExecutorchBackendConfig(passes=[_ReadCacheOnHost()])
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': buffer 'layer\.k_cache' moves to device memory.*still reads it"):
        zx.export(_decoder_program(), engine="tensorrt", backend_config=config)


@pytest.mark.parametrize("tamper,message", [
    (lambda build: build.aliased_io.pop(), "does not write .* in place"),
    (lambda build: build.aliased_io.append(blob.AliasedIO("offset_out", "offset", blob.AliasKind.USER)),
     "partial elision"),
])
def test_engine_aliasing_that_disagrees_with_the_promise_is_refused(monkeypatch, tamper, message):
    from zerokv.executorch import backend, engines

    class TamperedEngine(engines.TensorRTEngine):
        def build(self, program, aliased_inputs, device):
            build = super().build(program, aliased_inputs, device)
            tamper(build)
            return build

    monkeypatch.setattr(backend, "engine_named", lambda name, **options: TamperedEngine(**options))
    with pytest.raises(zx.ZeroCopyError, match=message):
        zx.export(_decoder_program(), engine="tensorrt")


def test_a_program_finalized_without_unstaging_is_refused_by_the_check():
    # What zerokv.export never does: repoint the mutations, then finalize with ExecuTorch's plain
    # config. The caches' copy-back is gone while the engine writes a staging copy.
    from executorch.exir import to_edge_transform_and_lower

    from zerokv.executorch import api
    from zerokv.executorch.engines import engine_named
    from zerokv.executorch.zero_copy import repoint_aliased_buffer_mutations

    program = _decoder_program().run_decompositions(api._decompositions())
    repoint_aliased_buffer_mutations(program, engine_named("tensorrt"), "forward")
    partitioner = zx.ZeroKVPartitioner("tensorrt", "cuda:0", "forward", True, None, api._marks(program))
    half_applied = to_edge_transform_and_lower(program, partitioner=[partitioner]).to_executorch(ExecutorchBackendConfig())
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': buffer 'layer\.[kv]_cache' is not a direct argument"):
        zx.check_zero_copy_kv(half_applied)
    with pytest.raises(zx.ZeroCopyError):
        zx.save(half_applied, "/nonexistent/never-written.pte")


def test_bad_arguments_are_refused_naming_what_is_wrong():
    with pytest.raises(zx.ZeroKVError, match="method 'decode': expected an ExportedProgram, got Linear"):
        zx.export({"decode": torch.nn.Linear(2, 2)}, engine="tensorrt")
    with pytest.raises(zx.ZeroKVError, match="unknown engine 'onnx'"):
        zx.export(_decoder_program(), engine="onnx")
    with pytest.raises(zx.ZeroKVError, match="device 'cpu'"):
        zx.export(_decoder_program(), engine="tensorrt", device="cpu")
    with pytest.raises(zx.RuntimeKVError, match="needs 0 < initial_capacity"):
        zx.KVCacheLayer("k", "v", max_capacity=8, initial_capacity=16)


def test_a_constant_ascending_index_is_written_in_place():
    # torch.tensor([9, 10, 11]) is a lifted constant that Edge clones with _clone_dim_order: the
    # verdict taken before partitioning (contiguous) must hold for the delegate's engine too.
    constant = lambda length, offset: torch.tensor([9, 10, 11])  # noqa: E731
    manager = zx.export(_decoder_program(constant, length=3), engine="tensorrt")
    _assert_caches_zero_copy(manager)
    ((_, parsed),) = _zero_copy_delegates(manager)
    assert {a.input for a in parsed.metadata.aliased_io} == {"b_layer_k_cache", "b_layer_v_cache"}


@pytest.mark.parametrize("profiles", [decode_and_prefill_profiles("input_ids", 1, max_prefill=16), None],
                         ids=["decode_and_prefill_profiles", "the_export_range"])
def test_one_engine_serves_every_query_length_the_export_allows(profiles):
    # The seed's engine: one plan whose profiles cover decode (1 token) and prefill (up to 16), every
    # cache aliased in it. Without profiles, its one profile spans the export's range: 1..16 too.
    program = tm.export_decoder(tm.TinyDecoder(tm.arange_plus_offset), 4, torch.tensor([0]), dynamic_length=True,
                                max_length=16)
    manager = zx.export(program, engine="tensorrt", engine_options={"profiles": profiles} if profiles else None)
    _assert_caches_zero_copy(manager)
    ((_, parsed),) = _zero_copy_delegates(manager)
    assert {a.input for a in parsed.metadata.aliased_io} == {"b_layer_k_cache", "b_layer_v_cache"}
    (input_ids,) = [b for b in parsed.metadata.bindings if b.name == "input_ids"]
    assert [(d.min, d.max) for d in input_ids.shape] == [(1, 1), (1, 16)]


def _planned_device_offsets(manager, method="forward"):
    offsets = {}
    for node in manager.exported_program(method).graph_module.graph.nodes:
        specs = node.meta.get("spec")
        for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
            if isinstance(spec, TensorSpec) and spec.mem_id is not None and spec.device == et_schema.DeviceType.CUDA:
                offsets[node.name] = spec.mem_offset
    return offsets


def test_device_memory_is_planned_at_tensorrts_256_byte_alignment():
    # TensorRT binds I/O tensors only at 256-byte aligned addresses; ExecuTorch plans at 16 by default
    # (here the staged one-element inputs would share a 256-byte line). The caller's planner is kept.
    config = ExecutorchBackendConfig()
    manager = zx.export(_decoder_program(), engine="tensorrt", backend_config=config)
    offsets = _planned_device_offsets(manager)
    assert any(name.startswith("_h2d_copy") for name in offsets), offsets
    assert {name: offset for name, offset in offsets.items() if offset % 256} == {}
    assert config.memory_planning_pass.alignment == 16


def test_per_method_planners_are_aligned_for_tensorrt_and_left_as_they_were():
    from executorch.exir.passes import MemoryPlanningPass

    from zerokv.executorch.engines import engine_named, planned_for

    decode = MemoryPlanningPass()
    config = ExecutorchBackendConfig(memory_planning_pass={"decode": decode})
    planned = planned_for(engine_named("tensorrt"), config, ["decode", "prefill"])
    assert {method: p.alignment for method, p in planned.memory_planning_pass.items()} == {"decode": 256, "prefill": 256}
    assert decode.alignment == 16 and ExecutorchBackendConfig().memory_planning_pass.alignment == 16
    assert config.memory_planning_pass == {"decode": decode}
    assert planned_for(engine_named("aoti", compile_device="cpu"), config, ["decode"]) is config
