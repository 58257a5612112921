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
halves or neither, refuses the options that would undo them (`refuse_input_unstaging`), and keeps
the finalized mutation map paired (`order_copyback_mutations_first`).
"""

from __future__ import annotations

import operator

import torch
from executorch.exir import schema as et_schema
from executorch.exir.delegate import executorch_call_delegate
from executorch.exir.passes.insert_write_back_for_buffers_pass import _inplace_lineage
from executorch.exir.passes.propagate_device_config import PropagateDeviceConfig
from executorch.exir.passes.propagate_device_pass import _get_lowered_module
from executorch.exir.tensor import TensorSpec
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.utils import _pytree as pytree

from zerokv import blob
from zerokv.executorch import specs
from zerokv.executorch.backend import ZeroCopyError
from zerokv.executorch.delegates import ALIASED_BUFFER, delegate_nodes, is_zerokv_delegate, parsed_blob
from zerokv.executorch.engines import readers_besides
from zerokv.kvwrite import is_kv_write

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
                "gone, so the engine writing it would have no output and could be removed as dead code; read the "
                "cache after writing it, or export with zero_copy_kv=False")
    program.graph_module.recompile()
    return declined


def _alias_decline(write, cache, engine, program) -> str | None:
    if not isinstance(write, torch.fx.Node) or not is_kv_write(write) or write.args[0] is not cache:
        return "its new value is not a KV write (index_copy, index_put, slice_scatter) of the buffer"
    if not engine.supports(write):
        return f"the engine does not run {write.target}"
    if readers_besides(cache, write):
        return "the buffer's old value is read besides its write, which an in-place write would change"
    return engine.alias_decline(write, program)


def zerokv_delegates(graph_module):
    """(node, lowered module, parsed blob) of each zerokv delegate; a blob that cannot be read is refused."""
    for node, lowered in delegate_nodes(graph_module):
        if not is_zerokv_delegate(lowered):
            continue
        try:
            parsed = parsed_blob(lowered)
        except blob.BlobFormatError as error:
            method = specs.read(lowered.compile_specs, specs.METHOD, "?")
            raise ZeroCopyError(f"method '{method}': the blob of zerokv delegate {node.args[0].name} is malformed: "
                                f"{error}; export the program again") from None
        yield node, lowered, parsed


def _aliased_argument_positions(parsed):
    """Positions (in the delegate's arguments) of the caller-owned caches its engine writes in place,
    as its blob records them; empty unless the aliased outputs are elided. Runtime-owned caches are
    not arguments."""
    if not parsed.aliased_outputs_elided:
        return []
    signature = blob.delegate_signature(parsed.metadata, True)
    names = [parsed.metadata.bindings[i].name for i in signature.inputs]
    runtime_owned = {name for layer in parsed.metadata.kv_layers for name in (layer.k_binding, layer.v_binding)}
    return [names.index(alias.input) for alias in parsed.metadata.aliased_io if alias.input not in runtime_owned]


def verify_lowered_method(graph_module, method: str):
    """After lowering: every marked cache reaches a zerokv delegate whose blob aliases it, and every
    zerokv delegate still has an output. A delegate nothing reads is a pure node: the next dead-code
    elimination (finalization runs several) erases it, with the cache writes it carries."""
    marked = {node for node in graph_module.graph.find_nodes(op="placeholder") if ALIASED_BUFFER in node.meta}
    covered = set()
    for node, _, parsed in zerokv_delegates(graph_module):
        covered.update(node.args[1 + position] for position in _aliased_argument_positions(parsed))
        if not any(user.target is operator.getitem for user in node.users):
            raise ZeroCopyError(
                f"method '{method}': the zerokv delegate {node.args[0].name} has no outputs, so nothing keeps it (or "
                "the cache writes it carries) in the program; return a value it computes, e.g. attend over the "
                "cache after writing it")
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
        for node, lowered, parsed in list(zerokv_delegates(graph_module)):
            method = specs.read(lowered.compile_specs, specs.METHOD, "?")
            device = specs.read(lowered.compile_specs, specs.TARGET_DEVICE, "cuda:0")
            device_index = specs.parse_device(device)
            for position in _aliased_argument_positions(parsed):
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
                "host memory and the engine's in-place write would fail); leave it True")
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
                f"in-place writes, but {user.name} ({user.target}) still reads it; drop that read, or export "
                "with zero_copy_kv=False")


def refuse_input_unstaging(config, programs):
    """Refuses PropagateDeviceConfig.skip_h2d_for_method_inputs for a method holding a zero-copy cache.

    That option is ExecuTorch's own un-staging of method inputs and needs each placeholder to have one
    user, while a zero-copy cache has two (its delegate, and the output it is its own mutation
    result for): finalization would fail halfway. It is refused before lowering in every spelling:
    ExecuTorch 1.5.1's PropagateDevicePass takes the per-method entry of a dict of configs, but tests
    the field itself only for truth, so a non-empty dict is on for every method whatever its values.
    """
    device_configs = config.propagate_device_config
    for method, program in programs.items():
        if isinstance(device_configs, dict):
            device_config = device_configs.get(method, PropagateDeviceConfig())
        else:
            device_config = device_configs
        skip = device_config.skip_h2d_for_method_inputs
        caches = sorted(node.meta[ALIASED_BUFFER] for node in program.graph.find_nodes(op="placeholder")
                        if ALIASED_BUFFER in node.meta)
        if skip and caches:
            raise ZeroCopyError(
                f"method '{method}': PropagateDeviceConfig(skip_h2d_for_method_inputs={skip!r}) is on for this "
                f"method (ExecuTorch reads any non-empty dict as on), and it cannot un-stage the zero-copy caches "
                f"{caches}; leave it False or {{}}: zerokv already hands those caches to their delegate uncopied")


def order_copyback_mutations_first(program) -> int:
    """Puts the mutations ExecuTorch copies back ahead of those it does not, on an Edge program.

    ExecuTorch 1.5.1's insert_write_back_for_buffers_pass inserts a copy_ for each mutation whose
    value is not already its own input (its `_inplace_lineage` predicate, asked here too), lists
    those copies followed by every output it copied nothing for, and pairs the mutation specs with
    that list by position. A zero-copy cache (its mutation repointed at its own placeholder) listed
    before a copy-back mutation such as a conv state would thus be paired with the conv state's copy
    and the conv state with the cache: a crossed map in the finalized graph_signature, which
    ExecuTorch's passes and tools read. Lowering re-derives the signature, so this runs after it.
    Returns the number of mutation slots whose value changed.
    """
    signature = program.graph_signature
    output_node = program.graph.output_node()
    values = list(output_node.args[0])
    output_specs = signature.output_specs
    slots = [index for index, spec in enumerate(output_specs)
             if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)]
    in_place = {index for index in slots if _inplace_lineage(values[index], signature, output_specs[index].kind)}
    order = [index for index in slots if index not in in_place] + [index for index in slots if index in in_place]
    moved = sum(slot != index for slot, index in zip(slots, order))
    if moved:
        old_specs, new_values = list(output_specs), list(values)
        for slot, index in zip(slots, order):
            output_specs[slot], new_values[slot] = old_specs[index], values[index]
        output_node.args = (tuple(new_values),)
        program.graph_module.recompile()
    return moved


def _refuse_crossed_mutations(exported_program, marked, method: str):
    """Each buffer mutation of a finalized method must be paired with its own write.

    The finalized graph no longer returns the mutations, and passes after the write-back rename the
    copies it inserted, so the pairing is read off the signature's names: a mutation named after a
    placeholder must be that buffer's own, and a zero-copy cache's must be its own placeholder (it
    has no copy). A crossing between two mutations that are neither (e.g. from upstream's reinplace
    pass) cannot be told from those names.
    """
    buffers = exported_program.graph_signature.inputs_to_buffers
    placeholders = {buffer: name for name, buffer in buffers.items()}
    for spec in exported_program.graph_signature.output_specs:
        if spec.kind != OutputKind.BUFFER_MUTATION or spec.arg.name == placeholders.get(spec.target):
            continue
        if spec.arg.name in buffers:
            paired = f"{spec.arg.name}, which holds buffer '{buffers[spec.arg.name]}'"
        elif placeholders.get(spec.target) in marked:
            paired = f"{spec.arg.name}, not with the zero-copy cache itself"
        else:
            continue
        raise ZeroCopyError(
            f"method '{method}': the mutation of buffer '{spec.target}' is paired with {paired} (a crossed mutation "
            "map); export it with zerokv.export, which keeps the copy-back mutations first")


def _is_device_spec(spec) -> bool:
    return isinstance(spec, TensorSpec) and spec.device == et_schema.DeviceType.CUDA


def _refuse_host_placement(cache, buffer, plan, graph, method: str):
    """The cache must be planned in device memory. Where the planner recorded the arenas' devices,
    its arena must be a CUDA one. A planner that records none (any callable can plan) leaves that
    unknown, but host-only planning puts every tensor in one arena: one that also holds host
    tensors is not device memory."""
    spec = cache.meta.get("spec")
    if not _is_device_spec(spec):
        raise ZeroCopyError(
            f"method '{method}': buffer '{buffer}' is not placed on the device ({getattr(spec, 'device', None)}); "
            "the engine writes it in device memory; finalize it with zerokv.executorch.export")
    if plan.non_const_buffer_device is not None:
        device_arenas = {entry.buffer_idx for entry in plan.non_const_buffer_device
                         if entry.device_type == et_schema.DeviceType.CUDA}
        if spec.mem_id not in device_arenas:
            raise ZeroCopyError(
                f"method '{method}': buffer '{buffer}' is planned in arena {spec.mem_id}, which the planner "
                "records as host memory; the engine writes it in device memory: plan it with ExecuTorch's "
                "device-aware MemoryPlanningPass (enable_non_cpu_memory_planning=True)")
        return
    for node in graph.nodes:
        for other in pytree.tree_leaves(node.meta.get("spec")):
            if (isinstance(other, TensorSpec) and other.mem_id == spec.mem_id and not other.const
                    and other.device == et_schema.DeviceType.CPU):
                raise ZeroCopyError(
                    f"method '{method}': buffer '{buffer}' is planned in arena {spec.mem_id}, which also holds host "
                    f"tensors ({node.name}): host-only planning, where the engine writes device memory; keep "
                    "ExecutorchBackendConfig.enable_non_cpu_memory_planning=True")


def check_zero_copy_kv(program_manager):
    """Refuses a finalized program whose zero-copy KV set-up is incomplete or inconsistent.

    In every method: each buffer mutation is paired with a value that writes that buffer. Each
    marked cache holds the buffer its mark names, is a direct argument of a zerokv delegate that
    writes it in place, and is planned in device memory. From the delegate side, each argument a
    zerokv delegate's blob says it writes in place is such a marked cache, so a delegate whose
    cache lost its mark is refused too, and a blob that cannot be read is. At least one cache must
    be zero-copy in the program. Raises ZeroCopyError naming the buffer and the method.
    """
    zero_copy_anywhere = False
    for method in program_manager.methods:
        exported_program = program_manager.exported_program(method)
        graph = exported_program.graph
        buffers = exported_program.graph_signature.inputs_to_buffers
        marked = [node for node in graph.find_nodes(op="placeholder") if ALIASED_BUFFER in node.meta]
        _refuse_crossed_mutations(exported_program, {node.name for node in marked}, method)
        written = {}
        for node, _, parsed in zerokv_delegates(exported_program.graph_module):
            for position in _aliased_argument_positions(parsed):
                written.setdefault(node.args[1 + position], (node.args[0].name, position))
        zero_copy_anywhere |= bool(marked or written)
        plan = _execution_plan(program_manager, method)
        for cache in marked:
            buffer = cache.meta[ALIASED_BUFFER]
            if buffers.get(cache.name) != buffer:
                raise ZeroCopyError(
                    f"method '{method}': placeholder {cache.name} holds buffer '{buffers.get(cache.name)}' but is "
                    f"marked as '{buffer}' (a crossed mark); export the program again")
            if cache not in written:
                raise ZeroCopyError(
                    f"method '{method}': buffer '{buffer}' is not a direct argument of a zerokv delegate "
                    "that writes it in place (was the program finalized without zerokv's config?); finalize it "
                    "with zerokv.executorch.export")
            _refuse_host_placement(cache, buffer, plan, graph, method)
        for argument, (delegate, position) in written.items():
            if argument not in marked:
                raise ZeroCopyError(
                    f"method '{method}': the zerokv delegate {delegate} writes argument {position} ({argument.name}) "
                    "in place, but it is not marked as a zero-copy cache (a lost mark, or a staging copy left in "
                    "place), so nothing guarantees the write lands in the buffer; export the program again")
    if not zero_copy_anywhere:
        raise ZeroCopyError("no method of the program has a KV cache marked for in-place update; export it with "
                            "zerokv.executorch.export(..., zero_copy_kv=True), which says why it declines a cache")


def _execution_plan(program_manager, method):
    for plan in program_manager.executorch_program.execution_plan:
        if plan.name == method:
            return plan
    raise ZeroCopyError(f"method '{method}' has no execution plan")
