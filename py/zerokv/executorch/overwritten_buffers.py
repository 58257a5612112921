"""Buffers every method overwrites before reading: state whose value never outlives a step.

transformers' ExecuTorch integration keeps each layer's fill level in a `cumulative_length` buffer.
Its forward first sets every one to cache_position[0] (so that one exported program serves several
generations), then the layer adds the step's length: the functional program reads the buffer only as
the destination of that whole overwrite, `aten.copy(buffer, cache_position[0])`, and mutates it to
cache_position[0] + T. No step reads what an earlier step left there.

Kept, that state costs a host round trip per layer and step: the buffer is staged into the
delegate (its old value is an operand of the copy, though unused), the new value comes back out of
it and is copied into the host buffer. zerokv's engines write in place only what the KV-write proof
accepts (TensorRT's one aliased output is its KV-cache-update layer's), so a counter would keep that
round trip whatever the engine. Dropping the state instead keeps every value the program computes:
the overwrite becomes its source, which the step reads as before; what goes is a value nothing reads.

A buffer is dropped only when that holds in every method that has it (a shared buffer is read
by all of them) and the caller did not ask for named mutable buffers (emit_mutable_buffer_names),
through which the host can read a buffer's value between steps.
"""

from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind, OutputKind


def drop_overwritten_buffers(programs, backend_config) -> dict[str, list[str]]:
    """Drops from `programs` ({method: functional ExportedProgram}, edited in place) each buffer
    that every method holding it overwrites whole before any read. Returns {method: [buffer]}.
    """
    if backend_config.emit_mutable_buffer_names:
        return {}
    overwrites = {method: _overwrites(program) for method, program in programs.items()}
    held = {method: _buffer_placeholders(program) for method, program in programs.items()}
    dropped = {}
    for method, program in programs.items():
        dead = [buffer for buffer in overwrites[method]
                if all(buffer in overwrites[other] for other in programs if buffer in held[other])]
        for buffer in dead:
            _drop(program, buffer, overwrites[method][buffer])
        if dead:
            program.graph.eliminate_dead_code()
            program.graph_module.recompile()
            dropped[method] = dead
    return dropped


def _buffer_placeholders(program):
    placeholders = {node.name: node for node in program.graph.find_nodes(op="placeholder")}
    return {spec.target: placeholders[spec.arg.name]
            for spec in program.graph_signature.input_specs if spec.kind == InputKind.BUFFER}


def _overwrites(program) -> dict[str, torch.fx.Node]:
    """{buffer: the copy that overwrites it} for each buffer whose only reader is that copy."""
    found = {}
    for buffer, placeholder in _buffer_placeholders(program).items():
        if len(placeholder.users) != 1:
            continue
        (copy,) = placeholder.users
        if copy.op != "call_function" or copy.target is not torch.ops.aten.copy.default:
            continue
        source = copy.args[1]
        # Only the copy's destination is the buffer (its source is a value of this step), and the
        # source is already the buffer's shape and dtype: the copy's value is the source itself,
        # neither broadcast nor converted.
        if copy.args[0] is not placeholder or not isinstance(source, torch.fx.Node) or source is placeholder:
            continue
        old, new = placeholder.meta["val"], source.meta.get("val")
        if isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype:
            found[buffer] = copy
    return found


def _drop(program, buffer, copy):
    graph, signature = program.graph, program.graph_signature
    placeholder = copy.args[0]
    copy.replace_all_uses_with(copy.args[1])
    graph.erase_node(copy)
    output = graph.output_node()
    kept = [(spec, value) for spec, value in zip(signature.output_specs, output.args[0])
            if not (spec.kind == OutputKind.BUFFER_MUTATION and spec.target == buffer)]
    signature.output_specs[:] = [spec for spec, _ in kept]
    output.args = (tuple(value for _, value in kept),)
    signature.input_specs[:] = [spec for spec in signature.input_specs
                                if not (spec.kind == InputKind.BUFFER and spec.target == buffer)]
    graph.erase_node(placeholder)
    program.constants.pop(buffer, None)
    program.state_dict.pop(buffer, None)
