"""The guards of zero-copy KV export, on real ExecuTorch programs with TensorRT delegates (TensorRT-RTX
plans, built on the CPU): every refusal is a zerokv.ZeroKVError naming what is at fault, the
finalized mutation map pairs each buffer with its own write, and check_zero_copy_kv refuses a
finalized program whose marks, delegates and placement disagree."""

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.propagate_device_config import PropagateDeviceConfig
from torch.export.graph_signature import OutputKind

import zerokv
import zerokv.executorch as zx
from zerokv import blob
from zerokv.aoti import AotiCompileError
from zerokv.blob import format_generated
from zerokv.executorch import api
from zerokv.executorch.delegates import ALIASED_BUFFER
from zerokv.executorch.engine_build import EngineBuildError
from zerokv.executorch.engines import engine_named
from zerokv.executorch.zero_copy import (
    UnstageAliasedBuffers,
    delegate_nodes,
    repoint_aliased_buffer_mutations,
    verify_lowered_method,
)
from zerokv.tensorrt import testing_models as tm
from zerokv.tensorrt.lowering import AliasingPromiseError, PlanBuildError
from zerokv.tensorrt.network import ConversionError
from zerokv.tensorrt.profiles import ProfileError


def _decoder_program():
    return tm.export_decoder(tm.TinyDecoder(tm.arange_plus_offset), 1, torch.tensor([3]))


class _Second(torch.nn.Module):
    """A second decoder whose caches are buffers of their own ("second.layer.k_cache"): two methods
    writing the same buffers are refused (ExecuTorch would give each method its own copy)."""

    def __init__(self):
        super().__init__()
        self.second = tm.TinyDecoder(tm.arange_plus_offset)

    def forward(self, input_ids, offset):
        return self.second(input_ids, offset)


def _two_method_programs():
    return {
        "prefill": tm.export_decoder(tm.TinyDecoder(tm.arange_plus_offset), 4, torch.tensor([0])),
        "decode": tm.export_decoder(_Second(), 1, torch.tensor([4])),
    }


def _mutations(manager, method="forward"):
    return [(spec.target, spec.arg.name) for spec in manager.exported_program(method).graph_signature.output_specs
            if spec.kind == OutputKind.BUFFER_MUTATION]


def _marked(manager, method="forward"):
    return {node.name: node for node in manager.exported_program(method).graph.find_nodes(op="placeholder")
            if ALIASED_BUFFER in node.meta}


# --- One error type -----------------------------------------------------------------------------

@pytest.mark.parametrize("error", [
    zx.ZeroCopyError, zx.RuntimeKVError, EngineBuildError, AliasingPromiseError, ConversionError, ProfileError,
    PlanBuildError, AotiCompileError,
])
def test_every_refusal_type_is_a_zerokv_error(error):
    assert issubclass(error, zx.ZeroKVError) and zx.ZeroKVError is zerokv.ZeroKVError


@pytest.mark.parametrize("arguments,message", [
    ({"engine_options": {"profile": []}}, r"engine_options: unknown option 'profile' for engine 'tensorrt'"),
    ({"engine_options": "cuda"}, r"engine_options: expected a dict"),
    ({"engine_options": {"profiles": [("decode", 1)]}}, r"engine_options\['profiles'\]: expected .*Profile"),
    ({"engine_options": {"profiles": None}}, r"engine_options\['profiles'\]: expected .*Profile"),
    ({"engine": "aoti", "engine_options": {"compile_device": "tpu"}}, r"engine_options\['compile_device'\]: 'tpu'"),
    ({"engine": "onnx"}, r"engine: unknown engine 'onnx'"),
    ({"device": "cpu"}, r"device 'cpu'"),
    ({"zero_copy_kv": "yes"}, r"zero_copy_kv: expected a bool"),
    ({"named_data": "file"}, r"named_data 'file': expected one of \['ptd', 'pte'\]"),
    ({"backend_config": {}}, r"backend_config: expected an ExecutorchBackendConfig"),
    ({"compile_config": {}}, r"compile_config: expected an EdgeCompileConfig"),
    ({"runtime_kv": ("k", "v")}, r"runtime_kv: expected a zerokv.executorch.RuntimeKV"),
    ({"other_partitioners": ["xnnpack"]}, r"other_partitioners\[0\]: expected an ExecuTorch Partitioner"),
])
def test_bad_arguments_are_refused_up_front_naming_the_argument(arguments, message):
    with pytest.raises(zerokv.ZeroKVError, match=message):
        zx.export(_decoder_program(), **{"engine": "tensorrt", **arguments})


def test_bad_programs_and_a_bad_manager_are_refused():
    with pytest.raises(zerokv.ZeroKVError, match="method 'decode': expected an ExportedProgram, got Linear"):
        zx.export({"decode": torch.nn.Linear(2, 2)}, engine="tensorrt")
    with pytest.raises(zerokv.ZeroKVError, match="programs: expected an ExportedProgram"):
        zx.export([], engine="tensorrt")
    with pytest.raises(zerokv.ZeroKVError, match="manager: expected the ExecutorchProgramManager"):
        zx.save("decode.pte", "/nonexistent/never-written.pte")


class CausalAttention(torch.nn.Module):
    """A decoder's attention step over its caches, with is_causal=True (no TensorRT conversion)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, tm.HEADS, tm.MAX_SEQ, tm.HEAD_DIM))
        self.register_buffer("v_cache", torch.zeros(1, tm.HEADS, tm.MAX_SEQ, tm.HEAD_DIM))

    def forward(self, q, k, v, offset):
        positions = torch.arange(k.shape[2]) + offset
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        return torch.nn.functional.scaled_dot_product_attention(q, self.k_cache, self.v_cache, is_causal=True)


def test_an_engine_that_cannot_build_the_delegate_is_refused_naming_the_method():
    step = torch.ones(1, tm.HEADS, 1, tm.HEAD_DIM)
    program = torch.export.export(CausalAttention(), (step, step, step, torch.tensor([2])))
    with pytest.raises(zerokv.ZeroKVError,
                       match=r"method 'forward', delegate over .*b_k_cache.*is_causal=True .*explicit attn_mask"):
        zx.export(program, engine="tensorrt")


# --- The finalized mutation map -----------------------------------------------------------------

class ConvState(torch.nn.Module):
    """A ring-shifted conv state: a mutable buffer whose update keeps ExecuTorch's copy-back."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(1, 4, tm.VOCAB))

    def forward(self, logits):
        shifted = torch.cat([self.state[:, 1:], logits[:, -1:]], dim=1)
        self.state.copy_(shifted)
        return logits + shifted.sum(dim=1, keepdim=True)


class DecoderThenConvState(torch.nn.Module):
    """torch.export lists the decoder's caches before the conv state (submodule order)."""

    def __init__(self):
        super().__init__()
        self.decoder = tm.TinyDecoder(tm.arange_plus_offset)
        self.conv = ConvState()

    def forward(self, input_ids, offset):
        return self.conv(self.decoder(input_ids, offset))


def _cache_first_program():
    with torch.no_grad():
        program = torch.export.export(DecoderThenConvState().eval(), (torch.tensor([[1]]), torch.tensor([3])))
    mutated = [s.target for s in program.run_decompositions({}).graph_signature.output_specs
               if s.kind == OutputKind.BUFFER_MUTATION]
    assert mutated == ["decoder.layer.k_cache", "decoder.layer.v_cache", "conv.state"], mutated
    return program


def test_the_mutation_map_pairs_each_buffer_with_its_write_when_a_cache_comes_first():
    manager = zx.export(_cache_first_program(), engine="tensorrt")
    mutations = dict(_mutations(manager))
    assert mutations["decoder.layer.k_cache"] == "b_decoder_layer_k_cache"
    assert mutations["decoder.layer.v_cache"] == "b_decoder_layer_v_cache"
    # The finalized graph names the copy differently (later passes rename it); one copy writes it back.
    assert mutations["conv.state"].startswith("copy_")
    graph = manager.exported_program().graph
    copies = [node for node in graph.nodes if node.target is torch.ops.aten.copy_.default]
    assert [copy.args[0].name for copy in copies] == ["b_conv_state"]
    zx.check_zero_copy_kv(manager)


def test_a_crossed_mutation_map_is_refused(monkeypatch):
    # Without the reorder, ExecuTorch's write-back pass pairs the caches with the conv state's copy.
    monkeypatch.setattr(api, "order_copyback_mutations_first", lambda program: 0, raising=False)
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': the mutation of buffer 'decoder\.layer\.k_cache' "
                                               r"is paired with copy_\w*, not with the zero-copy cache itself"):
        zx.export(_cache_first_program(), engine="tensorrt")


# --- Refusals before and after lowering ---------------------------------------------------------

@pytest.mark.parametrize("propagate_device_config", [
    PropagateDeviceConfig(skip_h2d_for_method_inputs=True),
    PropagateDeviceConfig(skip_h2d_for_method_inputs={"forward": True}),
    # ExecuTorch 1.5.1's PropagateDevicePass tests the field for truth: a non-empty dict is on for
    # every method, whatever its values.
    PropagateDeviceConfig(skip_h2d_for_method_inputs={"forward": False}),
    {"forward": PropagateDeviceConfig(skip_h2d_for_method_inputs=True)},
], ids=["bool", "per-method-dict", "all-false-dict", "config-per-method"])
def test_skip_h2d_for_a_method_with_a_zero_copy_cache_is_refused(propagate_device_config):
    config = ExecutorchBackendConfig(propagate_device_config=propagate_device_config)
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': .*skip_h2d_for_method_inputs.*'layer\.k_cache'"):
        zx.export(_decoder_program(), engine="tensorrt", backend_config=config)


def test_skip_h2d_that_the_pass_reads_as_off_is_kept():
    off = {"forward": PropagateDeviceConfig(skip_h2d_for_method_inputs={})}
    manager = zx.export(_decoder_program(), engine="tensorrt",
                        backend_config=ExecutorchBackendConfig(propagate_device_config=off))
    zx.check_zero_copy_kv(manager)


class ReadsUpdatedCacheOnHost(torch.nn.Module):
    """Reads the updated cache with an op TensorRT does not run (clamp), outside the delegate."""

    def __init__(self):
        super().__init__()
        self.decoder = tm.TinyDecoder(tm.arange_plus_offset)

    def forward(self, input_ids, offset):
        return self.decoder(input_ids, offset) + torch.clamp(self.decoder.layer.k_cache, -1.0, 1.0).sum()


def test_an_updated_cache_read_outside_its_delegate_is_refused():
    with torch.no_grad():
        program = torch.export.export(ReadsUpdatedCacheOnHost().eval(), (torch.tensor([[1]]), torch.tensor([3])))
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward', .*the updated value of cache "
                                               r"'decoder\.layer\.k_cache' is read outside the delegate.*zero_copy_kv=False"):
        zx.export(program, engine="tensorrt")


def test_a_delegate_left_with_no_outputs_is_refused():
    # A delegate nothing reads is a pure node: the next dead-code elimination would erase it, with
    # the in-place writes it carries. Here every read of a staged decoder delegate is cut.
    program = _decoder_program().run_decompositions(api._decompositions())
    partitioner = zx.ZeroKVPartitioner("tensorrt", "cuda:0", "forward", False, None, api._marks(program))
    graph_module = to_edge_transform_and_lower(program, partitioner=[partitioner]).exported_program().graph_module
    (node, _), = delegate_nodes(graph_module)
    stand_in = next(iter(graph_module.graph.find_nodes(op="placeholder")))
    for user in list(node.users):
        user.replace_all_uses_with(stand_in)
        graph_module.graph.erase_node(user)
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': the zerokv delegate lowered_module_0 has no outputs"):
        verify_lowered_method(graph_module, "forward")


# --- check_zero_copy_kv's negative cases --------------------------------------------------------

def test_a_crossed_mark_is_refused():
    manager = zx.export(_decoder_program(), engine="tensorrt")
    marked = _marked(manager)
    k, v = marked["b_layer_k_cache"], marked["b_layer_v_cache"]
    k.meta[ALIASED_BUFFER], v.meta[ALIASED_BUFFER] = v.meta[ALIASED_BUFFER], k.meta[ALIASED_BUFFER]
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': placeholder b_layer_k_cache holds buffer "
                                               r"'layer\.k_cache' but is marked as 'layer\.v_cache'"):
        zx.check_zero_copy_kv(manager)


def test_a_lost_mark_is_refused_from_the_delegate_side():
    manager = zx.export(_two_method_programs(), engine="tensorrt")
    for node in _marked(manager, "decode").values():
        del node.meta[ALIASED_BUFFER]
    with pytest.raises(zx.ZeroCopyError, match=r"method 'decode': the zerokv delegate \w+ writes argument \d+ "
                                               r"\(b_second_layer_[kv]_cache\) in place, but it is not marked"):
        zx.check_zero_copy_kv(manager)


def test_a_delegate_that_records_elision_but_names_no_alias_is_refused():
    manager = zx.export(_two_method_programs(), engine="tensorrt")
    for node in _marked(manager, "decode").values():
        del node.meta[ALIASED_BUFFER]
    (_, lowered), = delegate_nodes(manager.exported_program("decode").graph_module)
    parsed = blob.parse(lowered.processed_bytes)
    parsed.metadata.aliased_io.clear()
    parsed.aliased_outputs_elided = False
    data = bytearray(blob.serialize(parsed))
    header = format_generated.read_header(bytes(data))
    header.aliased_outputs_elided = True
    data[:blob.HEADER_SIZE] = format_generated.write_header(header)
    lowered._processed_bytes = bytes(data)
    with pytest.raises(zx.ZeroCopyError, match=r"method 'decode': the blob of zerokv delegate \w+ is malformed: "
                                               r"ELISION_WITHOUT_ALIASES"):
        zx.check_zero_copy_kv(manager)


class PlannerRecordingNoDevices(MemoryPlanningPass):
    """A caller's memory planner that places tensors as ExecuTorch's does but records no devices."""

    def run(self, graph_module, graph_signature=None):
        result = super().run(graph_module, graph_signature)
        graph_module.meta.pop("non_const_buffer_device", None)
        return result


def test_a_planner_that_records_no_devices_is_not_taken_for_host_memory():
    config = ExecutorchBackendConfig(memory_planning_pass=PlannerRecordingNoDevices())
    manager = zx.export(_decoder_program(), engine="tensorrt", backend_config=config)
    assert next(p for p in manager.executorch_program.execution_plan).non_const_buffer_device is None
    zx.check_zero_copy_kv(manager)


class DecoderThenClamp(torch.nn.Module):
    """A decoder step whose logits a host op reads (TensorRT does not run clamp)."""

    def __init__(self):
        super().__init__()
        self.decoder = tm.TinyDecoder(tm.arange_plus_offset)

    def forward(self, input_ids, offset):
        return torch.clamp(self.decoder(input_ids, offset), -1.0, 1.0)


def test_a_host_arena_program_is_refused():
    # What zerokv.export never does: the un-staging pass bound to a config that plans device memory,
    # finalized with one that plans everything in the one host arena. (Without a host tensor in the
    # method, such a program cannot be told from a planner that records no devices.)
    with torch.no_grad():
        program = torch.export.export(DecoderThenClamp().eval(), (torch.tensor([[1]]), torch.tensor([3])))
    program = program.run_decompositions(api._decompositions())
    repoint_aliased_buffer_mutations(program, engine_named("tensorrt"), "forward")
    partitioner = zx.ZeroKVPartitioner("tensorrt", "cuda:0", "forward", True, None, api._marks(program))
    edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
    config = ExecutorchBackendConfig(enable_non_cpu_memory_planning=False)
    config.to_out_var_pass = UnstageAliasedBuffers(ExecutorchBackendConfig(), config.to_out_var_pass)
    host_arena = edge.to_executorch(config)
    with pytest.raises(zx.ZeroCopyError, match=r"method 'forward': buffer 'decoder\.layer\.[kv]_cache' is planned in arena "
                                               r"\d+, which also holds host tensors"):
        zx.check_zero_copy_kv(host_arena)
