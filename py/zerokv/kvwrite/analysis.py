"""Decides whether an FX node writes a contiguous run of KV cache positions.

A backend may turn a cache write into one in-place block update (TensorRT's
IKVCacheUpdateLayer in LINEAR mode writes `update[:, :, s]` at `start + s`) only
when the written positions are provably `start, start + 1, ..., start + n - 1`.
A scattered index such as (5, 1, 9) would otherwise land at 5, 6, 7 without any
error, so everything that is not a proof of contiguity is a decline with a reason.

The proof is read off the graph structurally (`arange` with step 1, optionally
shifted by a single integer value) and, for indices that constant folding has
materialised, off the index's values. Both are needed because folding replaces a
static-length `arange` with a frozen constant, and a caller that asks before
folding and again after must get the same answer.

Nothing here depends on TensorRT.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Union

import torch
from torch import fx

aten = torch.ops.aten

# The sequence axis of a [batch, heads, max_seq_len, head_dim] cache.
DEFAULT_SEQUENCE_DIM = 2

# Given a node, its value if it is a compile-time constant, else None.
ConstantLookup = Callable[[fx.Node], Union[torch.Tensor, None]]

# A static position, or an FX node whose value is an integer: a SymInt-valued
# node (`sym_size`, SymInt arithmetic) or a 0-d / [1]-shaped integer tensor.
Position = Union[int, fx.Node]

# The ops that write a KV cache: the cache is argument 0 (of copy_, the slice it writes into) and
# the result has the cache's shape. Every engine and pass recognises a KV write by `is_kv_write`.
_INDEX_COPY_TARGETS = (aten.index_copy.default, aten.index_copy_.default)
_SLICE_SCATTER_TARGETS = (aten.slice_scatter.default,)
# index_put writes the positions an index tuple selects; this module does not read them, so it
# declines those writes, and an engine that needs the positions (TensorRT) leaves them.
_INDEX_PUT_TARGETS = (aten.index_put.default,)
_SLICE_TARGETS = (aten.slice.Tensor,)
_ARANGE_TARGETS = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_ADD_TARGETS = (aten.add.Tensor, aten.add.Scalar)
# Ops that forward an index unchanged as far as positions go (integer casts).
_VALUE_PRESERVING_TARGETS = (
    aten._to_copy.default,
    aten.to.dtype,
    aten.clone.default,
    aten.alias.default,
)
_SYMINT_ADD_TARGETS = (operator.add,)


@dataclasses.dataclass(frozen=True)
class WriteStart:
    """The first written position: `static_offset` plus the value of each dynamic term.

    A dynamic term is an FX node holding one integer: a SymInt-valued node, or a
    0-d or [1]-shaped integer tensor (Hugging Face's static cache keeps its
    cumulative length as a [1] tensor).
    """

    static_offset: int
    dynamic_terms: tuple[fx.Node, ...] = ()

    @property
    def is_static(self) -> bool:
        return not self.dynamic_terms

    def key(self) -> tuple[int, tuple[str, ...]]:
        """A comparable form, stable across graph rewrites that keep node names."""
        return (self.static_offset, tuple(sorted(n.name for n in self.dynamic_terms)))


@dataclasses.dataclass(frozen=True)
class KVWriteOp:
    """The parts of a cache write, independent of the op that spells it.

    Exactly one of `index` (index_copy) or the slice bounds (slice_scatter,
    copy_ into a slice) describes the written positions.
    """

    node: fx.Node
    cache: fx.Node
    update: fx.Node
    dim: int
    index: fx.Node | None = None
    slice_start: Position | None = None
    slice_end: Position | None = None
    slice_step: Position | None = None


@dataclasses.dataclass(frozen=True)
class ContiguousWrite:
    """`op` writes positions `start, start + 1, ..., start + length - 1` of its cache."""

    op: KVWriteOp
    start: WriteStart
    length: int | torch.SymInt

    @property
    def node(self) -> fx.Node:
        return self.op.node


@dataclasses.dataclass(frozen=True)
class DeclinedWrite:
    """`node` writes a cache but contiguity could not be proven; `reason` says why."""

    node: fx.Node
    reason: str
    op: KVWriteOp | None = None


KVWriteAnalysis = Union[ContiguousWrite, DeclinedWrite]


class _Decline(Exception):
    """Internal: carries a decline reason out of the recursive proof."""


def op_overload(target):
    """The ATen OpOverload behind a call_function target: itself, or the one an ExecuTorch Edge
    op (which wraps it as `_op`) stands for."""
    wrapped = getattr(target, "_op", None)
    if not isinstance(target, torch._ops.OpOverload) and isinstance(wrapped, torch._ops.OpOverload):
        return wrapped
    return target


def is_kv_write(node: fx.Node) -> bool:
    """Whether `node` writes a KV cache, in ATen or in ExecuTorch's Edge dialect: index_copy(_),
    index_put, slice_scatter, or copy_ into a slice."""
    if node.op != "call_function":
        return False
    target = op_overload(node.target)
    if target in _INDEX_COPY_TARGETS or target in _SLICE_SCATTER_TARGETS or target in _INDEX_PUT_TARGETS:
        return True
    if target is aten.copy_.default:
        destination = node.args[0]
        return isinstance(destination, fx.Node) and op_overload(destination.target) in _SLICE_TARGETS
    return False


def describes_positions(node: fx.Node) -> bool:
    """Whether `describe_kv_write` says which positions the KV write `node` writes (all but index_put)."""
    return is_kv_write(node) and op_overload(node.target) not in _INDEX_PUT_TARGETS


def describe_kv_write(node: fx.Node) -> KVWriteOp:
    """Splits a cache write into cache, update, dimension and positions.

    Raises:
      ValueError: `node` is not a KV write whose positions this module describes.
    """
    if not is_kv_write(node):
        raise ValueError(
            f"node '{node.name}' ({node.target}) is not a KV cache write: expected "
            "aten.index_copy(_), aten.index_put, aten.slice_scatter or aten.copy_ into an aten.slice"
        )
    if not describes_positions(node):
        raise ValueError(
            f"node '{node.name}' ({node.target}) writes the positions of an index tuple, which are not "
            "analysed; write the cache with index_copy or a slice to have them proven contiguous"
        )
    target = op_overload(node.target)
    if target in _INDEX_COPY_TARGETS:
        cache, dim, index, update = _args(node, "self", "dim", "index", "source")
        return KVWriteOp(node=node, cache=cache, update=update, dim=dim, index=index)
    if target in _SLICE_SCATTER_TARGETS:
        cache, update = _args(node, "self", "src")
        dim, start, end, step = _slice_bounds(node, first=2)
        return KVWriteOp(
            node=node, cache=cache, update=update, dim=dim,
            slice_start=start, slice_end=end, slice_step=step,
        )
    destination, update = _args(node, "self", "src")
    cache = destination.args[0]
    dim, start, end, step = _slice_bounds(destination, first=1)
    return KVWriteOp(
        node=node, cache=cache, update=update, dim=dim,
        slice_start=start, slice_end=end, slice_step=step,
    )


def analyze_kv_write(
    node: fx.Node,
    *,
    constants: ConstantLookup | None = None,
    sequence_dim: int = DEFAULT_SEQUENCE_DIM,
) -> KVWriteAnalysis:
    """Proves that `node` writes one contiguous run of cache positions, or says why not.

    Args:
      node: a cache write (see `is_kv_write`).
      constants: resolves compile-time constant nodes to their values; defaults to
        `get_attr` nodes of the owning GraphModule (where constant folding puts its
        results). Use `exported_program_constants` for lifted constants.
      sequence_dim: the cache's sequence axis; a write along any other is declined.

    Returns:
      A ContiguousWrite with the start and length, or a DeclinedWrite with the reason.
    """
    lookup = constants or module_attribute_constants
    try:
        op = describe_kv_write(node)
    except ValueError as error:
        return DeclinedWrite(node=node, reason=str(error))
    try:
        cache_rank = _tensor_meta(op.cache).dim()
        dim = op.dim + cache_rank if op.dim < 0 else op.dim
        wanted = sequence_dim + cache_rank if sequence_dim < 0 else sequence_dim
        if dim != wanted:
            raise _Decline(
                f"writes along dimension {op.dim} of '{op.cache.name}', not the "
                f"sequence dimension {sequence_dim}"
            )
        if op.index is not None:
            start, length = _prove_index(op.index, lookup)
        else:
            start, length = _prove_slice(op)
    except _Decline as decline:
        return DeclinedWrite(node=node, reason=str(decline), op=op)
    return ContiguousWrite(op=op, start=start, length=length)


def module_attribute_constants(node: fx.Node) -> torch.Tensor | None:
    """Constants held by the owning GraphModule (`get_attr` nodes)."""
    if node.op != "get_attr":
        return None
    value = node.graph.owning_module
    for atom in str(node.target).split("."):
        value = getattr(value, atom, None)
        if value is None:
            return None
    return value if isinstance(value, torch.Tensor) else None


def exported_program_constants(program: torch.export.ExportedProgram) -> ConstantLookup:
    """A lookup for an ExportedProgram: lifted constants, then its module's attributes.

    Only CONSTANT_TENSOR placeholders count: a buffer can be written by the
    caller between calls, so its value at export time proves nothing.
    """
    from torch.export.graph_signature import InputKind

    by_placeholder = {
        spec.arg.name: program.constants[spec.target]
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.CONSTANT_TENSOR and spec.target in program.constants
    }

    def lookup(node: fx.Node) -> torch.Tensor | None:
        if node.op == "placeholder":
            value = by_placeholder.get(node.name)
            return value if isinstance(value, torch.Tensor) else None
        return module_attribute_constants(node)

    return lookup


def _prove_index(index: fx.Node, lookup: ConstantLookup) -> tuple[WriteStart, int | torch.SymInt]:
    if not isinstance(index, fx.Node):
        raise _Decline(f"index {index!r} is not a graph value")
    value = _tensor_meta(index)
    if value.dim() != 1:
        raise _Decline(
            f"index '{index.name}' has rank {value.dim()} (shape {tuple(value.shape)}); "
            "a rank-1 index is required"
        )
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise _Decline(f"index '{index.name}' has non-integer dtype {value.dtype}")
    return _prove_run(index, lookup)


def _prove_run(node: fx.Node, lookup: ConstantLookup) -> tuple[WriteStart, int | torch.SymInt]:
    """Start and length of the ascending step-1 run that `node` (rank 1) holds."""
    constant = lookup(node)
    if constant is not None:
        return _constant_run(node, constant)
    if node.op != "call_function":
        raise _Decline(
            f"index '{node.name}' is a runtime value ({node.op}); its positions "
            "cannot be proven contiguous"
        )
    if node.target in _ARANGE_TARGETS:
        return _arange_run(node)
    if node.target in _VALUE_PRESERVING_TARGETS:
        source = node.args[0]
        if _tensor_meta(node).dtype.is_floating_point:
            raise _Decline(f"index '{node.name}' is cast to a floating-point dtype")
        return _prove_run(source, lookup)
    if node.target in _ADD_TARGETS:
        return _shifted_run(node, lookup)
    raise _Decline(
        f"index '{node.name}' is produced by {node.target}, which is not an arange, "
        "a shift of one by a single value, or a constant"
    )


def _constant_run(node: fx.Node, value: torch.Tensor) -> tuple[WriteStart, int]:
    if value.dim() != 1:
        raise _Decline(f"constant index '{node.name}' has rank {value.dim()}; rank 1 is required")
    if value.numel() == 0:
        raise _Decline(f"constant index '{node.name}' is empty")
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise _Decline(f"constant index '{node.name}' has non-integer dtype {value.dtype}")
    positions = value.to(torch.int64).tolist()
    steps = {b - a for a, b in zip(positions, positions[1:])}
    if steps - {1}:
        raise _Decline(
            f"constant index '{node.name}' holds {_preview(positions)}, which is not an "
            "ascending run with step 1"
        )
    return WriteStart(static_offset=positions[0]), len(positions)


def _arange_run(node: fx.Node) -> tuple[WriteStart, int | torch.SymInt]:
    if node.target is aten.arange.default:
        start, step = 0, 1
    elif node.target is aten.arange.start:
        start, step = node.args[0], 1
    else:
        start = node.args[0]
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
    if isinstance(step, fx.Node) or step != 1:
        raise _Decline(f"index '{node.name}' is an arange with step {_describe(step)}, not 1")
    if isinstance(start, float):
        raise _Decline(f"index '{node.name}' is an arange starting at float {start}")
    if isinstance(start, fx.Node):
        return WriteStart(0, (start,)), _tensor_meta(node).shape[0]
    return WriteStart(int(start)), _tensor_meta(node).shape[0]


def _shifted_run(node: fx.Node, lookup: ConstantLookup) -> tuple[WriteStart, int | torch.SymInt]:
    if node.kwargs.get("alpha", 1) != 1:
        raise _Decline(f"index '{node.name}' adds with alpha {node.kwargs['alpha']}, not 1")
    lhs, rhs = node.args[0], node.args[1]
    # HF writes `arange(n) + cumulative_length`, but nothing fixes that order, and
    # with n == 1 both operands may be [1]-shaped: try each as the run.
    first_decline = None
    for run_operand, shift_operand in ((lhs, rhs), (rhs, lhs)):
        if not _is_rank_one(run_operand):
            continue
        try:
            start, length = _prove_run(run_operand, lookup)
        except _Decline as decline:
            first_decline = first_decline or decline
            continue
        shift = _single_value(shift_operand, node, lookup)
        if isinstance(shift, int):
            return WriteStart(start.static_offset + shift, start.dynamic_terms), length
        return WriteStart(start.static_offset, start.dynamic_terms + (shift,)), length
    if first_decline is not None:
        raise first_decline
    raise _Decline(f"index '{node.name}' adds two values, neither of which is rank 1")


def _single_value(operand, owner: fx.Node, lookup: ConstantLookup) -> Position:
    """`operand` as one integer that shifts every position alike."""
    if isinstance(operand, bool) or isinstance(operand, float):
        raise _Decline(f"index '{owner.name}' is shifted by {operand!r}, not an integer")
    if isinstance(operand, int):
        return operand
    if not isinstance(operand, fx.Node):
        raise _Decline(f"index '{owner.name}' is shifted by unsupported value {operand!r}")
    value = operand.meta.get("val")
    if isinstance(value, torch.SymInt):
        return operand
    if not isinstance(value, torch.Tensor):
        raise _Decline(f"index '{owner.name}' is shifted by '{operand.name}', whose value is unknown")
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise _Decline(f"index '{owner.name}' is shifted by '{operand.name}' of dtype {value.dtype}")
    if value.dim() > 1 or (value.dim() == 1 and not _is_static_one(value.shape[0])):
        raise _Decline(
            f"index '{owner.name}' is shifted by '{operand.name}' of shape {tuple(value.shape)}; "
            "only a Python int, a 0-d or a [1]-shaped tensor shifts every position alike"
        )
    constant = lookup(operand)
    if constant is not None:
        return int(constant.reshape(()).item())
    return operand


def _prove_slice(op: KVWriteOp) -> tuple[WriteStart, int | torch.SymInt]:
    node = op.node
    step = op.slice_step
    if isinstance(step, fx.Node) or step != 1:
        raise _Decline(f"'{node.name}' writes a slice with step {_describe(step)}, not 1")
    start = _position(op.slice_start, node)
    length = _tensor_meta(op.update).shape[op.dim]
    if isinstance(start, int):
        return WriteStart(start), length
    if isinstance(start, fx.Node) and start.target in _SYMINT_ADD_TARGETS:
        lhs, rhs = start.args
        if isinstance(lhs, int) or isinstance(rhs, int):
            constant, term = (lhs, rhs) if isinstance(lhs, int) else (rhs, lhs)
            return WriteStart(constant, (term,)), length
    return WriteStart(0, (start,)), length


def _position(value, node: fx.Node) -> Position:
    if value is None:
        return 0
    if isinstance(value, int):
        if value < 0:
            raise _Decline(f"'{node.name}' slices from negative position {value}")
        return value
    if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.SymInt):
        return value
    raise _Decline(f"'{node.name}' slices from {_describe(value)}, not an integer position")


def _slice_bounds(node: fx.Node, first: int) -> tuple[int, Position, Position, Position]:
    names = ("dim", "start", "end", "step")
    defaults = (0, None, None, 1)
    values = []
    for offset, (name, default) in enumerate(zip(names, defaults)):
        position = first + offset
        if position < len(node.args):
            values.append(node.args[position])
        else:
            values.append(node.kwargs.get(name, default))
    return tuple(values)


def _args(node: fx.Node, *names: str) -> tuple:
    values = []
    for position, name in enumerate(names):
        if position < len(node.args):
            values.append(node.args[position])
        elif name in node.kwargs:
            values.append(node.kwargs[name])
        else:
            raise ValueError(f"node '{node.name}' ({node.target}) has no argument '{name}'")
    return tuple(values)


def _tensor_meta(node) -> torch.Tensor:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        name = node.name if isinstance(node, fx.Node) else repr(node)
        raise _Decline(f"'{name}' carries no tensor metadata (meta['val']); run it through torch.export")
    return value


def _is_rank_one(operand) -> bool:
    if not isinstance(operand, fx.Node):
        return False
    value = operand.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == 1


def _is_static_one(extent) -> bool:
    return isinstance(extent, int) and extent == 1


def _describe(value) -> str:
    return f"'{value.name}'" if isinstance(value, fx.Node) else repr(value)


def _preview(positions: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(p) for p in positions[:limit])
    return f"({shown}{', ...' if len(positions) > limit else ''})"


def analyze_kv_writes(
    graph: fx.Graph,
    *,
    constants: ConstantLookup | None = None,
    sequence_dim: int = DEFAULT_SEQUENCE_DIM,
) -> Mapping[fx.Node, KVWriteAnalysis]:
    """`analyze_kv_write` for every cache write in `graph`, in graph order."""
    return {
        node: analyze_kv_write(node, constants=constants, sequence_dim=sequence_dim)
        for node in graph.nodes
        if is_kv_write(node)
    }
