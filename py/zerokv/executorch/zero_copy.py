"""Zero-copy KV: the two halves, and the checks that make a half-applied set-up impossible.

By default ExecuTorch pays for a KV cache update twice per step: PropagateDevicePass stages the cache
into device memory with an `_h2d_copy` before the delegate, and the delegate returns the updated
cache as an output that a write-back `copy_` copies into the buffer again. An engine that writes
the cache in place makes both copies pointless. Two passes remove them, at the only points where
each can run:

  repoint_aliased_buffer_mutations   before partitioning: each KV buffer mutation the engine can write
                                     in place is pointed at the buffer's own placeholder, so nothing
                                     is copied back and the updated cache leaves the delegate's outputs
  UnstageAliasedBuffers              as the `to_out_var_pass` (after PropagateDevicePass, before memory
                                     planning): the `_h2d_copy` of each such buffer is removed, so the
                                     delegate receives the caller's buffer, planned in device memory

Which buffers are un-staged is read from each delegate's blob (its engine's aliased I/O), never from
the shape of the graph. `check_zero_copy_kv` verifies a finalized program. zerokv.export applies both
halves or neither.
"""

from __future__ import annotations

import operator

import torch
from executorch.exir import schema as et_schema
from executorch.exir.delegate import executorch_call_delegate
from executorch.exir.passes.propagate_device_pass import _get_lowered_module
from executorch.exir.tensor import TensorSpec
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from zerokv import blob
from zerokv.executorch import specs
from zerokv.executorch.backend import ALIASED_BUFFER, ZeroCopyError, is_zerokv_delegate, parsed_blob
from zerokv.executorch.engines import is_kv_write, value_readers

_H2D = torch.ops.et_copy._h2d_copy.default


def repoint_aliased_buffer_mutations(program, engine, method: str) -> dict[str, str]:
    """Points each KV buffer mutation `engine` can write in place at the buffer's placeholder.

    `program` is a functional ExportedProgram (Edge or ATen) before partitioning. Returns
    {buffer: reason} for the buffer mutations left as copy-backs, and marks each repointed
    placeholder with ALIASED_BUFFER. Raises ZeroCopyError where repointing would lose a write.
    """
    graph = program.graph
    placeholders = {node.name: node for node in graph.find_nodes(op="placeholder")}
    buffer_placeholder = {
        spec.target: placeholders[spec.arg.name]
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.BUFFER
    }
    output_node = graph.output_node()
    values = list(output_node.args[0])
    declined, repointed = {}, []
    for index, spec in enumerate(program.graph_signature.output_specs):
        if spec.kind != OutputKind.BUFFER_MUTATION:
            continue
        cache = buffer_placeholder[spec.target]
        write = values[index]
        reason = _alias_decline(write, cache, engine, program)
        if reason:
            declined[spec.target] = reason
            continue
        values[index] = cache
        spec.arg.name = cache.name
        cache.meta[ALIASED_BUFFER] = spec.target
        repointed.append((spec.target, write))
    output_node.args = (tuple(values),)
    graph.eliminate_dead_code()
    for buffer, write in repointed:
        if write.graph is not graph or not write.users:
            raise ZeroCopyError(
                f"method '{method}': nothing reads the write of buffer '{buffer}' once its copy-back is "
                "gone, so the engine writing it would have no output and could be removed as dead code")
    program.graph_module.recompile()
    return declined


def _alias_decline(write, cache, engine, program) -> str | None:
    if not isinstance(write, torch.fx.Node) or not is_kv_write(write) or write.args[0] is not cache:
        return "its new value is not a KV write (index_copy, index_put, slice_scatter) of the buffer"
    if not engine.supports(write):
        return f"the engine does not run {write.target}"
    if value_readers(cache) != [write]:
        return "the buffer's old value is read besides its write, which an in-place write would change"
    return engine.alias_decline(write, program)


def delegate_nodes(graph_module):
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is executorch_call_delegate:
            lowered = _get_lowered_module(graph_module, node)
            if lowered is not None:
                yield node, lowered


def _aliased_argument_positions(lowered):
    """Positions (in the delegate's arguments) of the caller-owned caches its engine writes in place,
    as its blob records them; empty unless the aliased outputs are elided. Runtime-owned caches are
    not arguments."""
    parsed = parsed_blob(lowered)
    if not parsed.aliased_outputs_elided:
        return []
    signature = blob.delegate_signature(parsed.metadata, True)
    names = [parsed.metadata.bindings[i].name for i in signature.inputs]
    runtime_owned = {name for layer in parsed.metadata.kv_layers for name in (layer.k_binding, layer.v_binding)}
    return [names.index(alias.input) for alias in parsed.metadata.aliased_io if alias.input not in runtime_owned]


def verify_lowered_method(graph_module, method: str):
    """After lowering: every marked cache reaches a zerokv delegate whose blob aliases it, and every
    such delegate still has an output (else it would be dead code)."""
    marked = {node for node in graph_module.graph.find_nodes(op="placeholder") if ALIASED_BUFFER in node.meta}
    covered = set()
    for node, lowered in delegate_nodes(graph_module):
        if not is_zerokv_delegate(lowered):
            continue
        positions = _aliased_argument_positions(lowered)
        for position in positions:
            covered.add(node.args[1 + position])
        if positions and not any(user.target is operator.getitem for user in node.users):
            raise ZeroCopyError(f"method '{method}': every output of a zerokv delegate would be elided")
    for cache in marked - covered:
        raise ZeroCopyError(
            f"method '{method}': buffer '{cache.meta[ALIASED_BUFFER]}' lost its copy-back, but no zerokv "
            "delegate writes it in place")


class UnstageAliasedBuffers(PassBase):
    """The `to_out_var_pass` of a zero-copy program: un-stages the caches zerokv delegates write in
    place, then runs the caller's own `to_out_var_pass`.

    A marked cache's `_h2d_copy` feeding a zerokv delegate whose blob aliases that argument is
    removed, and the buffer itself is placed on the delegate's device. Refused, naming the buffer and
    the method: planning that puts everything in host memory, and a cache that anything else reads
    (another backend's staging copy, a host op), which would then read device memory.
    """

    def __init__(self, config, inner):
        super().__init__()
        self.config = config
        self.inner = inner

    def call(self, graph_module):
        changed = False
        for node, lowered in list(delegate_nodes(graph_module)):
            if not is_zerokv_delegate(lowered):
                continue
            method = specs.read(lowered.compile_specs, specs.METHOD, "?")
            device = specs.read(lowered.compile_specs, specs.TARGET_DEVICE, "cuda:0")
            device_index = specs.parse_device(device)
            for position in _aliased_argument_positions(lowered):
                changed |= self._unstage(graph_module, node, 1 + position, method, device_index)
        for cache in graph_module.graph.find_nodes(op="placeholder"):
            if ALIASED_BUFFER in cache.meta:
                self._refuse_other_readers(cache)
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
        result = self.inner(graph_module)
        return PassResult(result.graph_module, changed or result.modified)

    def _unstage(self, graph_module, delegate, argument, method, device_index) -> bool:
        staged = delegate.args[argument]
        cache = staged.args[0] if staged.op == "call_function" and staged.target is _H2D else staged
        buffer = cache.meta.get(ALIASED_BUFFER)
        if cache.op != "placeholder" or buffer is None:
            raise ZeroCopyError(
                f"method '{method}': a zerokv delegate writes argument {argument - 1} in place, but it is "
                f"{staged.name}, not a caller-owned cache marked for zero-copy")
        if not self.config.enable_non_cpu_memory_planning:
            raise ZeroCopyError(
                f"method '{method}': buffer '{buffer}' must be planned in device memory, but "
                "ExecutorchBackendConfig.enable_non_cpu_memory_planning is False (everything would be "
                "host memory and the engine's in-place write would fail)")
        args = list(delegate.args)
        args[argument] = cache
        delegate.args = tuple(args)
        spec = cache.meta["spec"]
        spec.device = et_schema.DeviceType.CUDA
        spec.device_index = device_index
        cache.meta["zerokv_method"] = method
        if staged is not cache and not staged.users:
            graph_module.graph.erase_node(staged)
        return True

    def _refuse_other_readers(self, cache):
        method = cache.meta.get("zerokv_method", "?")
        for user in cache.users:
            if user.op == "output":
                continue
            if user.op == "call_function" and user.target is executorch_call_delegate:
                lowered = _get_lowered_module(user.graph.owning_module, user)
                if is_zerokv_delegate(lowered):
                    continue
            raise ZeroCopyError(
                f"method '{method}': buffer '{cache.meta[ALIASED_BUFFER]}' moves to device memory for "
                f"in-place writes, but {user.name} ({user.target}) still reads it")


def _is_device_spec(spec) -> bool:
    return isinstance(spec, TensorSpec) and spec.device == et_schema.DeviceType.CUDA


def check_zero_copy_kv(program_manager):
    """Refuses a finalized program whose zero-copy KV set-up is incomplete.

    In every method, each marked cache must be a direct argument of a zerokv delegate that writes it
    in place, and be planned in device memory; and at least one cache must be marked in the program.
    Raises ZeroCopyError naming the buffer and the method.
    """
    marked_anywhere = False
    for method in program_manager.methods:
        graph_module = program_manager.exported_program(method).graph_module
        direct = set()
        for node, lowered in delegate_nodes(graph_module):
            if is_zerokv_delegate(lowered):
                direct.update(node.args[1 + p] for p in _aliased_argument_positions(lowered))
        plan = _execution_plan(program_manager, method)
        device_buffers = {
            entry.buffer_idx for entry in (plan.non_const_buffer_device or [])
            if entry.device_type == et_schema.DeviceType.CUDA
        }
        for cache in graph_module.graph.find_nodes(op="placeholder"):
            buffer = cache.meta.get(ALIASED_BUFFER)
            if buffer is None:
                continue
            marked_anywhere = True
            if cache not in direct:
                raise ZeroCopyError(
                    f"method '{method}': buffer '{buffer}' is not a direct argument of a zerokv delegate "
                    "that writes it in place (was the program finalized without zerokv's config?)")
            spec = cache.meta.get("spec")
            if not _is_device_spec(spec) or spec.mem_id not in device_buffers:
                raise ZeroCopyError(
                    f"method '{method}': buffer '{buffer}' is planned in host memory (mem_id "
                    f"{getattr(spec, 'mem_id', None)}); the engine writes it in device memory")
    if not marked_anywhere:
        raise ZeroCopyError("no method of the program has a KV cache marked for in-place update")


def _execution_plan(program_manager, method):
    for plan in program_manager.executorch_program.execution_plan:
        if plan.name == method:
            return plan
    raise ZeroCopyError(f"method '{method}' has no execution plan")
