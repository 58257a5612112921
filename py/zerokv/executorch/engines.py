"""The engine kinds a zerokv delegate can hold, behind one small interface.

An engine adapter answers three questions for the partitioner and `preprocess`:
  supports(node)             can the engine run this FX node?
  alias_decline(write, ...)  can the engine write this KV cache update in place? None, or the reason
  build(program, ...)        compile the delegate's program: engine code, I/O bindings, aliased I/O,
                             and the named data (weights, plans) the blob refers to by key

`build` is told which inputs are caller-owned buffers whose writes were promised to land in place
(`aliased_inputs`, placeholder name -> buffer). The blob records what the engine itself reports as
aliased; zero_copy.py checks the two agree and refuses the export when they do not.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator

import executorch.exir  # noqa: F401  (registers the dim_order_ops the Edge dialect uses)
import torch
from torch import fx

from zerokv import blob, kvwrite
from zerokv.errors import ZeroKVError
from zerokv.executorch import aoti_engine, megakernel_engine, tensorrt_engine
from zerokv.executorch.engine_build import EngineBuild
from zerokv.tensorrt.converters import CONVERTERS
from zerokv.tensorrt.kv_cache import kv_write_alias_decline

# Edge spells copies with a dim order; their ATen forms (the dim order dropped, see engine_program).
DIM_ORDER_OPS = {
    torch.ops.dim_order_ops._to_dim_order_copy.default: torch.ops.aten._to_copy.default,
    torch.ops.dim_order_ops._clone_dim_order.default: torch.ops.aten.clone.default,
}

ENGINE_KINDS = {"aoti": blob.EngineKind.AOTI, "tensorrt": blob.EngineKind.TENSORRT,
                "megakernel": blob.EngineKind.MEGAKERNEL}

_aten = torch.ops.aten
# The Edge dialect spells views as copies; engines take the views (they never alias a view's input).
_VIEW_OF_COPY = {
    _aten.alias_copy.default: _aten.alias.default,
    _aten.expand_copy.default: _aten.expand.default,
    _aten.permute_copy.default: _aten.permute.default,
    _aten.select_copy.int: _aten.select.int,
    _aten.slice_copy.Tensor: _aten.slice.Tensor,
    _aten.squeeze_copy.dim: _aten.squeeze.dim,
    _aten.squeeze_copy.dims: _aten.squeeze.dims,
    _aten.t_copy.default: _aten.t.default,
    _aten.transpose_copy.int: _aten.transpose.int,
    _aten.unsqueeze_copy.default: _aten.unsqueeze.default,
    _aten.view_copy.default: _aten.view.default,
}


def aten_target(node: fx.Node):
    """The ATen overload an engine sees for an FX node, whether its target is an Edge or an ATen op."""
    target = kvwrite.op_overload(node.target)
    if target in DIM_ORDER_OPS:
        return DIM_ORDER_OPS[target]
    return _VIEW_OF_COPY.get(target, target)


# Ops every engine takes whole: the KV write the engines alias, and attention (whose decomposition
# would scatter the attention of a decoder layer over several partitions).
PRESERVED_OPS = (torch.ops.aten.index_copy.default, torch.ops.aten.scaled_dot_product_attention.default)


def value_readers(node: fx.Node):
    """The users of `node` that read its contents (not only its shape, which a write never changes)."""
    return [user for user in node.users if not (user.op == "call_function" and aten_target(user) is _aten.sym_size.int)]


def readers_besides(cache: fx.Node, write: fx.Node):
    """The readers of `cache`'s old value that writing `write` in place could change: every reader
    but `write` itself and those proven to read none of the rows it writes (kvwrite.unaffected_by)."""
    return [reader for reader in value_readers(cache) if reader is not write and not kvwrite.unaffected_by(reader, write)]


def _is_write_back(value, cache: fx.Node) -> bool:
    return (isinstance(value, fx.Node) and value.op == "call_function" and aten_target(value) is _aten.copy.default
            and value.args[0] is cache)


def written_back(value, cache: fx.Node):
    """What an input mutation of `cache` returns, seen through its write-backs: `src` when `value` is
    `copy(cache, src)` (export and to_edge each spell a user input's mutation that way), repeatedly."""
    while _is_write_back(value, cache):
        value = value.args[1]
    return value


def write_backs(value, cache: fx.Node):
    """The chain of write-back copies of `cache` ending in `value`, outermost first."""
    chain = []
    while _is_write_back(value, cache):
        chain.append(value)
        value = value.args[1]
    return chain


def _tensor_shape_supported(node: fx.Node) -> bool:
    return node.target is operator.getitem or isinstance(
        node.meta.get("val"), (torch.Tensor, tuple, list, int, torch.SymInt))


class AotiEngine:
    """AOTInductor: compiles the delegate's program into a package the runtime loads with libtorch.

    It runs every ATen op, and writes any index_copy / index_put / slice_scatter of a caller-owned
    cache in place, whatever the index (no contiguity is needed to be correct in place).
    """

    kind = blob.EngineKind.AOTI
    binding_alignment = None  # ExecuTorch's own planning alignment serves it

    def __init__(self, compile_device=None, cuda_graph=False, coordinate_descent_tuning=False):
        self.compile_device = compile_device or aoti_engine.default_compile_device()
        self.cuda_graph = cuda_graph
        self.coordinate_descent_tuning = coordinate_descent_tuning

    def supports(self, node: fx.Node) -> bool:
        return node.op == "call_function" and _tensor_shape_supported(node)

    def alias_decline(self, write: fx.Node, program) -> str | None:
        return None

    def build(self, program, aliased_inputs, device: str) -> EngineBuild:
        return aoti_engine.build(program, aliased_inputs, device, self.compile_device, self.cuda_graph,
                                 self.coordinate_descent_tuning)


class TensorRTEngine:
    """TensorRT: a network built with the TensorRT (or TensorRT-RTX) builder, serialized as a plan.

    A KV write is aliased only when it provably writes a contiguous run of positions of a cache
    with static batch, heads, head_dim and length (zerokv.kvwrite); others fall back to a scatter.
    """

    kind = blob.EngineKind.TENSORRT
    # IExecutionContext::setTensorAddress takes only 256-byte aligned addresses; the runtime adapter
    # refuses others (cc/engines/tensorrt/binding_checks.h).
    binding_alignment = 256

    def __init__(self, profiles=None):
        self.profiles = profiles

    def supports(self, node: fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if kvwrite.is_kv_write(node):
            # Lowered as a KV cache update layer, or a scatter where not provably contiguous: either
            # needs the written positions.
            return kvwrite.describes_positions(node)
        return aten_target(node) in CONVERTERS

    def alias_decline(self, write: fx.Node, program) -> str | None:
        return kv_write_alias_decline(write, kvwrite.exported_program_constants(program))

    def build(self, program, aliased_inputs, device: str) -> EngineBuild:
        return tensorrt_engine.build(program, aliased_inputs, device, self.profiles)


class MegakernelEngine:
    """The MEGAKERNEL engine: a transformers Llama model's decode step as one persistent CUDA kernel
    (zerokv.megakernel.llama_step's op, and the KV writes of its rows, which it writes in place)."""

    kind = blob.EngineKind.MEGAKERNEL
    binding_alignment = None

    def supports(self, node: fx.Node) -> bool:
        return megakernel_engine.supports(node)

    def alias_decline(self, write: fx.Node, program) -> str | None:
        return megakernel_engine.alias_decline(write)

    def build(self, program, aliased_inputs, device: str) -> EngineBuild:
        return megakernel_engine.build(program, aliased_inputs, device)


def planned_for(engine, config, methods):
    """`config` with the memory of `methods` planned at `engine.binding_alignment`.

    A copy: the caller's config and planners, and ExecuTorch's default planner (one object shared by
    every ExecutorchBackendConfig), are left as they are. A planner without an `alignment` is kept;
    the runtime then refuses a misaligned binding by name.
    """
    alignment = engine.binding_alignment
    if alignment is None:
        return config

    def aligned(planner):
        current = getattr(planner, "alignment", None)
        if current is None or current % alignment == 0:
            return planner
        planner = copy.copy(planner)
        planner.alignment = math.lcm(current, alignment)
        return planner

    planners = config.memory_planning_pass
    if isinstance(planners, dict):
        # ExecuTorch plans a method missing from the dict with its default planner.
        default = type(config)().memory_planning_pass
        planners = {method: aligned(planners.get(method, default)) for method in {*planners, *methods}}
    else:
        planners = aligned(planners)
    return dataclasses.replace(config, memory_planning_pass=planners)


def engine_named(name: str, **options):
    if name == "aoti":
        return AotiEngine(**options)
    if name == "tensorrt":
        return TensorRTEngine(**options)
    if name == "megakernel":
        return MegakernelEngine(**options)
    raise ZeroKVError(f"engine: unknown engine {name!r}; zerokv has {sorted(ENGINE_KINDS)}")


def engine_module(name: str):
    """The module of an engine kind: its build and its option <-> compile spec encoding."""
    if name == "aoti":
        return aoti_engine
    if name == "tensorrt":
        return tensorrt_engine
    if name == "megakernel":
        return megakernel_engine
    raise ZeroKVError(f"engine: unknown engine {name!r}; zerokv has {sorted(ENGINE_KINDS)}")
