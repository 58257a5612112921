"""Readers of a cache's old value that a write of the cache in place provably cannot change.

An in-place write changes the buffer every other reader of the old value sees, so zero-copy declines
a write whose cache has another reader. One kind of reader is safe, and is proven so here: an op that
reads only the rows before a position, when the write writes that position's row alone. A fused
decode step is one: it attends over the committed rows [0, position) and this step's own row, which
it computes, and the write puts that row at `position`.

An op says which rows it reads with `declare_reads_rows_before`; `unaffected_by(reader, write)` is
the proof, read off the graph: the write is an index_copy along the sequence axis whose index is the
very node the reader takes as its position, and holds one element.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from zerokv.kvwrite.analysis import DEFAULT_SEQUENCE_DIM, describe_kv_write, is_kv_write, op_overload

# node -> (the node holding its position, the caches of which it reads rows [0, position) only).
Footprint = Callable[[fx.Node], tuple[fx.Node, tuple[fx.Node, ...]]]

_ROWS_BEFORE: dict[torch._ops.OpOverload, Footprint] = {}
_INDEX_COPIES = (torch.ops.aten.index_copy.default, torch.ops.aten.index_copy_.default)


def declare_reads_rows_before(op: torch._ops.OpOverload, footprint: Footprint) -> None:
    """Declares that each call of `op` reads, of the caches `footprint(node)` names, only the rows
    before the position it names (along the sequence axis, DEFAULT_SEQUENCE_DIM)."""
    _ROWS_BEFORE[op] = footprint


def unaffected_by(reader: fx.Node, write: fx.Node) -> bool:
    """Whether `reader` provably reads none of the rows the KV write `write` writes."""
    footprint = _ROWS_BEFORE.get(op_overload(reader.target)) if reader.op == "call_function" else None
    if footprint is None or not is_kv_write(write) or op_overload(write.target) not in _INDEX_COPIES:
        return False
    position, caches = footprint(reader)
    described = describe_kv_write(write)
    index = described.index.meta.get("val") if isinstance(described.index, fx.Node) else None
    return (described.cache in caches and described.dim == DEFAULT_SEQUENCE_DIM and described.index is position
            and isinstance(index, torch.Tensor) and tuple(index.shape) == (1,))
