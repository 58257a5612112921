"""The MEGAKERNEL engine kind: a Llama decode step (zerokv.megakernel.llama_step) as one persistent
CUDA kernel (cc/engines/megakernel/megakernel_engine.h says what the blob holds).

The delegate is the step's op and the KV writes of the rows it returns, nothing else: the kernel
computes exactly that. Each cache is written in place (the kernel writes row `position` while it
attends over the rows before it), so every cache must be one zero-copy promised or the runtime owns.
The weights are the op's constants, each a named data entry; the payload is the step's settings.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.export.graph_signature import InputKind, OutputKind

from zerokv import blob
from zerokv.aoti import add_constant, binding_table
from zerokv.executorch.engine_build import EngineBuild, EngineBuildError, check_option_names
from zerokv.kvwrite import is_kv_write, op_overload
from zerokv.megakernel.llama_step import LAYER_WEIGHTS, MODEL_WEIGHTS

STEP = torch.ops.zerokv.llama_decode_step.default
_SELECT = (torch.ops.aten.select.int, torch.ops.aten.select_copy.int)
_INDEX_COPY = (torch.ops.aten.index_copy.default, torch.ops.aten.index_copy_.default)


def options_to_specs(options):
    check_option_names("megakernel", options, ())
    return []


def options_from_specs(compile_specs):
    return {}


def _is_step(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and op_overload(node.target) is STEP


def _rows_of(node):
    """(step node, row index) when `node` selects one of a step's returned rows, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and op_overload(node.target) in _SELECT):
        return None
    rows, dim, index = node.args[:3]
    if dim != 0 or not (isinstance(rows, fx.Node) and rows.target is operator.getitem and rows.args[1] == 1
                        and _is_step(rows.args[0])):
        return None
    return rows.args[0], index


def supports(node: fx.Node) -> bool:
    """The step, its results and the KV writes of its rows: the graph the kernel computes."""
    if node.op != "call_function":
        return False
    if _is_step(node) or (node.target is operator.getitem and _is_step(node.args[0])) or _rows_of(node):
        return True
    return is_kv_write(node) and op_overload(node.target) in _INDEX_COPY and _rows_of(node.args[3]) is not None


def alias_decline(write: fx.Node) -> str | None:
    """Why the kernel cannot write `write` in place, or None: it writes row `position` of its i-th
    cache with its i-th row, along the sequence axis, and nothing else."""
    found = _rows_of(write.args[3]) if op_overload(write.target) in _INDEX_COPY else None
    if found is None:
        return "it does not write a row the step returns"
    step, index = found
    cache, dim, position = write.args[:3]
    caches = step.args[2]
    if not (0 <= index < len(caches)) or caches[index] is not cache:
        return f"it writes row {index} of the step into a cache the step does not read as its cache {index}"
    if dim != 2 or position is not step.args[1]:
        return "it writes the row along another axis than the positions, or at another position than the step's"
    return None


def _constant(program, node, what):
    spec = next((s for s in program.graph_signature.input_specs if s.arg.name == node.name), None)
    if spec is None or spec.kind == InputKind.USER_INPUT:
        raise EngineBuildError(f"{what} is an input of the delegate, not a constant; the kernel reads its weights "
                               "once, at load")
    value = program.state_dict[spec.target] if spec.target in program.state_dict else program.constants[spec.target]
    # A whole, compact storage: the engine reads each constant as a whole named data entry.
    return value.detach().contiguous().clone()


def build(program, aliased_inputs, device: str) -> EngineBuild:
    steps = [node for node in program.graph.nodes if _is_step(node)]
    if len(steps) != 1:
        raise EngineBuildError(f"the delegate holds {len(steps)} calls of {STEP}; the engine runs one step")
    (step,) = steps
    token, position, caches, weights, rms_eps, rope_attention_scaling = step.args
    layers = len(caches) // 2
    names = [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    expected = [getattr(node, "name", repr(node)) for node in (token, position, *caches)]
    if names != expected:
        raise EngineBuildError(f"the delegate's inputs are {names}; the kernel takes the step's token, position and "
                               f"caches, in that order: {expected}")
    not_in_place = [node.name for node in caches if node.name not in aliased_inputs]
    if not_in_place:
        raise EngineBuildError(f"caches {not_in_place} are not written in place: the kernel writes every cache where "
                               "it lies, so declare them in runtime_kv (zerokv.megakernel.export.export_decode does)")
    signature = program.graph_signature
    returned = program.graph.output_node().args[0]
    written = {}
    for spec, value in zip(signature.output_specs, returned):
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            written[spec.target] = value
        elif not (spec.kind == OutputKind.USER_OUTPUT and value.target is operator.getitem and value.args == (step, 0)):
            raise EngineBuildError(f"the delegate returns {value.name}, not only the step's logits and cache writes")
    for index, cache in enumerate(caches):
        write = written.get(cache.name)
        if write is None or write.args[0] is not cache or alias_decline(write) or _rows_of(write.args[3])[1] != index:
            raise EngineBuildError(f"cache '{cache.name}' is not written with the step's row {index} at its position")
    if len(weights) != len(LAYER_WEIGHTS) * layers + len(MODEL_WEIGHTS):
        raise EngineBuildError(f"the step has {len(weights)} weights; {layers} layers take "
                               f"{len(LAYER_WEIGHTS) * layers + len(MODEL_WEIGHTS)}")
    constant_names = [f"layers.{layer}.{name}" for layer in range(layers) for name in LAYER_WEIGHTS]
    built = EngineBuild(payload=f"rms_eps {rms_eps!r}\nrope_attention_scaling {rope_attention_scaling!r}\n".encode(),
                        bindings=[], aliased_io=[])
    for name, node in zip(constant_names + list(MODEL_WEIGHTS), weights):
        tensor = _constant(program, node, f"weight {name}")
        wanted = torch.float32 if name == "inv_freq" else torch.bfloat16
        if tensor.dtype != wanted:
            raise EngineBuildError(f"weight {name} is {tensor.dtype}; the kernel reads {wanted}")
        add_constant(built, name, tensor)
    built.bindings, built.aliased_io = binding_table(program, blob.Device.CUDA)
    return built
