"""zerokv's public export API: one call that lowers, applies zero-copy KV whole, and finalizes.

    manager = zerokv.export({"prefill": prefill_ep, "decode": decode_ep}, engine="aoti")
    zerokv.save(manager, "model.pte")

There is deliberately no two-step form: the repointed buffer mutations (before partitioning) and the
un-staged device copies (when the program is finalized) are applied together or not at all, because
either one alone gives a program whose cache silently stops updating.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

import torch
from executorch.exir import (
    EdgeCompileConfig,
    ExecutorchBackendConfig,
    ExecutorchProgramManager,
    to_edge_transform_and_lower,
)
from executorch.exir.backend.partitioner import Partitioner
from torch._decomp import core_aten_decompositions
from torch.export.graph_signature import InputKind, OutputKind

from zerokv.errors import ZeroKVError
from zerokv.executorch import specs
from zerokv.executorch.backend import ZeroCopyError
from zerokv.executorch.delegates import ALIASED_BUFFER, RUNTIME_KV
from zerokv.executorch.engines import PRESERVED_OPS, engine_module, engine_named, planned_for
from zerokv.executorch.overwritten_buffers import drop_overwritten_buffers
from zerokv.executorch.partitioner import KeepingZeroKVOps, ZeroKVPartitioner
from zerokv.executorch.runtime_kv import RuntimeKV, detach_runtime_kv, mark_runtime_kv
from zerokv.executorch.specs import NAMED_DATA_TAG
from zerokv.executorch.zero_copy import (
    UnstageAliasedBuffers,
    check_zero_copy_kv,
    order_copyback_mutations_first,
    refuse_input_unstaging,
    repoint_aliased_buffer_mutations,
    verify_lowered_method,
    zerokv_delegates,
)

logger = logging.getLogger(__name__)


def _decompositions():
    """Core ATen decompositions, less the ops the engines take whole."""
    table = core_aten_decompositions()
    for op in PRESERVED_OPS:
        table.pop(op, None)
    return table


def export(
    programs,
    *,
    engine: str = "aoti",
    device: str = "cuda:0",
    zero_copy_kv: bool = True,
    backend_config: ExecutorchBackendConfig | None = None,
    compile_config: EdgeCompileConfig | None = None,
    engine_options: dict | None = None,
    other_partitioners=(),
    runtime_kv: RuntimeKV | None = None,
    constant_methods: dict | None = None,
    named_data: str = "ptd",
):
    """Lowers `programs` to an ExecuTorch program whose zerokv delegates run on `device`.

    Args:
      programs: an ExportedProgram (the method "forward") or {method name: ExportedProgram}.
      engine: "aoti" (AOTInductor), "tensorrt", or "megakernel" (a transformers Llama model's decode
        step as one persistent CUDA kernel, over runtime-owned caches: zerokv.megakernel.export).
      zero_copy_kv: write the caller's KV caches in place (no staging copy, no copy-back). Only
        mutations the engine can write in place are affected; the others (e.g. a conv state) keep
        ExecuTorch's copy-back. Buffers that every method overwrites before reading them (transformers'
        cumulative_length counters) are dropped, their copy-backs with them: see overwritten_buffers.py.
        False gives plain ExecuTorch behaviour.
      backend_config: the caller's ExecutorchBackendConfig; its memory planning and its own
        to_out_var_pass keep working (zero-copy composes onto it).
      engine_options: for "tensorrt" {"profiles": [...]}; for "aoti" {"compile_device": "cpu"|"cuda"}.
      other_partitioners: other backends' partitioners, applied to what zerokv's engine leaves. Their
        delegates are never un-staged: only zerokv's engines promise in-place writes.
      runtime_kv: caches the zerokv runtime owns (allocates, grows, binds); they leave the methods'
        inputs and are never serialized. See runtime_kv.py.
      constant_methods: {method name: value} written as methods that return the value (e.g.
        get_max_seq_len, get_vocab_size, use_kv_cache: the metadata ExecuTorch's LLM runners read);
        a name may not be one of `programs`' methods.
      named_data: where the delegates' weights and TensorRT plans go (ExecuTorch named data): "ptd", a
        data file that `save` writes beside the .pte, or "pte", the .pte's own named data segment.

    Returns:
      The finalized ExecutorchProgramManager. With zero_copy_kv it has passed check_zero_copy_kv.

    Raises:
      ZeroKVError: every refusal, before anything is built when an argument is at fault. A subclass
        names what: ZeroCopyError (zero-copy cannot be applied safely; names buffer and method),
        RuntimeKVError, EngineBuildError (the engine cannot build a delegate; names the method).
    """
    programs = _checked_arguments(programs, engine, device, zero_copy_kv, backend_config, compile_config,
                                  engine_options, other_partitioners, runtime_kv, constant_methods, named_data)
    adapter = engine_named(engine, **(engine_options or {}))
    prepared = {}
    declined = {}
    storage_keys = runtime_kv.storage_keys() if runtime_kv else {}
    decomposed = {method: _decomposed(program) for method, program in programs.items()}
    if zero_copy_kv:
        for method, buffers in drop_overwritten_buffers(decomposed, backend_config or ExecutorchBackendConfig()).items():
            logger.info("zerokv: method '%s' drops buffers %s: every method overwrites them before reading them, "
                        "so no value they hold outlives a step", method, buffers)
    _refuse_unshared_buffers(decomposed, zero_copy_kv, backend_config or ExecutorchBackendConfig())
    for method, program in decomposed.items():
        if runtime_kv:
            mark_runtime_kv(program, runtime_kv, storage_keys, method)
        if zero_copy_kv:
            declined[method] = repoint_aliased_buffer_mutations(program, adapter, method)
            for buffer, reason in declined[method].items():
                logger.warning("zerokv: method '%s' keeps the copy-back of buffer '%s': %s", method, buffer, reason)
        prepared[method] = program
    if zero_copy_kv:
        refuse_input_unstaging(backend_config or ExecutorchBackendConfig(), prepared)
    partitioners = {
        method: [
            ZeroKVPartitioner(engine, device, method, zero_copy_kv, engine_options, _marks(program),
                              program.range_constraints, named_data),
            *(KeepingZeroKVOps(other) for other in other_partitioners),
        ]
        for method, program in prepared.items()
    }
    edge = to_edge_transform_and_lower(prepared, partitioner=partitioners, compile_config=compile_config,
                                       constant_methods=constant_methods)
    for method in prepared:
        detach_runtime_kv(edge.exported_program(method), method)
        order_copyback_mutations_first(edge.exported_program(method))
        verify_lowered_method(edge.exported_program(method).graph_module, method)

    base = planned_for(adapter, backend_config or ExecutorchBackendConfig(), prepared)
    repointed = any(ALIASED_BUFFER in node.meta for program in prepared.values()
                    for node in program.graph.find_nodes(op="placeholder"))
    if not zero_copy_kv or (runtime_kv and not repointed):
        return edge.to_executorch(base)
    _refuse_shared_device_buffers(base)
    config = dataclasses.replace(base)
    config.to_out_var_pass = UnstageAliasedBuffers(config, base.to_out_var_pass)
    manager = edge.to_executorch(config)
    try:
        check_zero_copy_kv(manager)
    except ZeroCopyError as error:
        if any(declined.values()):
            raise ZeroCopyError(f"{error}; declined: {declined}") from None
        raise
    return manager


def _decomposed(program):
    program = program.run_decompositions(_decompositions())
    # The result shares the caller's constants table, where torch.export keeps non-persistent
    # buffers (Hugging Face's caches and rotary inv_freq), and its state dict; lowering takes from
    # them what delegates consume, and drop_overwritten_buffers what no step reads, which would break
    # the caller's program. This copy has tables of its own.
    return torch.export.ExportedProgram(
        root=program.graph_module,
        graph=program.graph,
        graph_signature=program.graph_signature,
        state_dict=dict(program.state_dict),
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=dict(program.constants),
        verifiers=program.verifiers,
    )


def _refuse_unshared_buffers(programs, zero_copy_kv, config):
    """A buffer one method writes and another uses is two buffers in ExecuTorch, one per method,
    unless memory planning shares mutable buffers (host memory only, so never with zero-copy)."""
    if len(programs) < 2 or (not zero_copy_kv and _shares_mutable_buffers(config)):
        return
    used = {method: {spec.target for spec in program.graph_signature.input_specs if spec.kind == InputKind.BUFFER}
            for method, program in programs.items()}
    for method, program in programs.items():
        written = {spec.target for spec in program.graph_signature.output_specs
                   if spec.kind == OutputKind.BUFFER_MUTATION}
        others = sorted(other for other in programs if other != method and written & used[other])
        if others:
            shared = sorted(written.intersection(set().union(*(used[other] for other in others))))
            raise ZeroCopyError(
                f"buffers {shared} are written by method '{method}' and used by {others}, but each ExecuTorch "
                "method gets its own copy of a buffer, so the writes would not reach them. Pass the caches as "
                "method inputs and declare them runtime-owned (zerokv.executorch.export(..., "
                "runtime_kv=RuntimeKV(...))) to share them between methods"
                + ("" if zero_copy_kv else ", or plan with share_mutable_buffers=True"))


def _shares_mutable_buffers(config):
    planners = config.memory_planning_pass
    planners = planners.values() if isinstance(planners, dict) else [planners]
    return any(getattr(planner, "share_mutable_buffers", False) for planner in planners)


def _checked_arguments(programs, engine, device, zero_copy_kv, backend_config, compile_config, engine_options,
                       other_partitioners, runtime_kv, constant_methods, named_data):
    """{method: ExportedProgram}, after refusing any bad argument with a ZeroKVError naming it."""
    if isinstance(programs, torch.export.ExportedProgram):
        programs = {"forward": programs}
    if not isinstance(programs, dict) or not programs:
        raise ZeroKVError(f"programs: expected an ExportedProgram or a non-empty {{method: ExportedProgram}}, "
                          f"got {type(programs).__name__}")
    for method, program in programs.items():
        if not isinstance(program, torch.export.ExportedProgram):
            raise ZeroKVError(f"method '{method}': expected an ExportedProgram, got {type(program).__name__}")
    engine_module(engine).options_to_specs({} if engine_options is None else engine_options)
    specs.parse_device(device)
    specs.parse_named_data(named_data)
    if not isinstance(zero_copy_kv, bool):
        raise ZeroKVError(f"zero_copy_kv: expected a bool, got {zero_copy_kv!r}")
    for name, value, expected, described in (
        ("backend_config", backend_config, ExecutorchBackendConfig, "an ExecutorchBackendConfig"),
        ("compile_config", compile_config, EdgeCompileConfig, "an EdgeCompileConfig"),
        ("runtime_kv", runtime_kv, RuntimeKV, "a zerokv.executorch.RuntimeKV"),
    ):
        if value is not None and not isinstance(value, expected):
            raise ZeroKVError(f"{name}: expected {described} or None, got {type(value).__name__}")
    if not isinstance(other_partitioners, (list, tuple)):
        raise ZeroKVError(f"other_partitioners: expected a list of ExecuTorch Partitioners, "
                          f"got {type(other_partitioners).__name__}")
    for index, partitioner in enumerate(other_partitioners):
        if not isinstance(partitioner, Partitioner):
            raise ZeroKVError(f"other_partitioners[{index}]: expected an ExecuTorch Partitioner, "
                              f"got {type(partitioner).__name__}")
    if constant_methods is not None:
        if not isinstance(constant_methods, dict) or not all(isinstance(name, str) for name in constant_methods):
            raise ZeroKVError(f"constant_methods: expected {{method name: value}} or None, got {constant_methods!r}")
        clashing = sorted(set(constant_methods) & set(programs))
        if clashing:
            raise ZeroKVError(f"constant_methods {clashing} are also methods of the program")
    return programs


def _marks(program):
    return {
        node.name: {key: node.meta[key] for key in (ALIASED_BUFFER, RUNTIME_KV) if key in node.meta}
        for node in program.graph.find_nodes(op="placeholder")
    }


def _refuse_shared_device_buffers(config):
    if _shares_mutable_buffers(config):
        raise ZeroCopyError(
            "share_mutable_buffers cannot share zero-copy KV caches across methods: ExecuTorch 1.5.1 shares "
            "mutable buffers only in host memory (mem_id 1), and the engines write the caches in device "
            "memory. Declare the caches runtime-owned (zerokv.executorch.export(..., runtime_kv=...)) to "
            "share their storage between methods")


def _has_zero_copy(manager) -> bool:
    """Whether any method has a zero-copy delegate or a cache marked for one."""
    for method in manager.methods:
        exported_program = manager.exported_program(method)
        if any(ALIASED_BUFFER in node.meta for node in exported_program.graph.find_nodes(op="placeholder")):
            return True
        if any(parsed.aliased_outputs_elided for _, _, parsed in zerokv_delegates(exported_program.graph_module)):
            return True
    return False


def data_path(path: str) -> str:
    """Where `save` writes the named data of the .pte at `path`: beside it, as <name>.ptd."""
    return os.path.splitext(path)[0] + ".ptd"


def save(manager, path: str):
    """Writes the .pte of `manager` to `path`, and its named data kept outside the .pte (exported
    with named_data="ptd", the default) to data_path(path), after check_zero_copy_kv when it has
    zero-copy delegates. Load both: load_program(path) in Python, Module(path, data_path(path)) in
    C++. Each file is written whole or not at all (an existing file is never left truncated), the
    data file first; a data file an earlier save left beside `path` goes when this program has none.
    Returns the paths written."""
    if not isinstance(manager, ExecutorchProgramManager):
        raise ZeroKVError(f"manager: expected the ExecutorchProgramManager zerokv.executorch.export returns, "
                          f"got {type(manager).__name__}")
    if _has_zero_copy(manager):
        check_zero_copy_kv(manager)
    directory = os.path.dirname(os.path.abspath(path))
    written = []
    with tempfile.TemporaryDirectory(dir=directory, prefix=".zerokv-") as data_dir:
        manager.write_tensor_data_to_file(data_dir)
        for name in sorted(os.listdir(data_dir)):
            if name != f"{specs.NAMED_DATA_TAG}.ptd":
                raise ZeroKVError(f"the program keeps named data '{name}' of another backend outside the .pte; "
                                  "zerokv.save writes only zerokv's")
            os.replace(os.path.join(data_dir, name), data_path(path))
            written.append(data_path(path))
    if not written and os.path.exists(data_path(path)):
        os.unlink(data_path(path))
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".zerokv-", delete=False) as out:
        try:
            manager.write_to_file(out)
        except BaseException:
            os.unlink(out.name)
            raise
    os.replace(out.name, path)
    return [path, *written]


def load_program(path: str):
    """The executorch.runtime Program at `path`, with the data file `save` wrote beside it, if any.
    Load the zerokv backend library first (see README.md)."""
    from executorch.runtime import Runtime

    data = data_path(path)
    return Runtime.get().load_program(path, data_path=data if os.path.exists(data) else None)
