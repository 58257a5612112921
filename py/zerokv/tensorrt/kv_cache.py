"""The KV cache write converter: one in-place KV-cache-update layer, or a scatter.

A write proven contiguous (zerokv.kvwrite) into a cache that is a network input
with static [B, N, S_max, H] becomes an IKVCacheUpdateLayer in LINEAR mode, whose
output TensorRT binds to the cache's own memory (aliased I/O). Anything else is
written by an element scatter into a new tensor: slower, never aliased, but the
update still happens, including with dynamic shapes. A write is never dropped.
"""

from __future__ import annotations

import dataclasses

import torch

from torch import fx

from zerokv.kvwrite import (
    ConstantLookup,
    ContiguousWrite,
    DeclinedWrite,
    KVWriteAnalysis,
    KVWriteOp,
    analyze_kv_write,
)
from zerokv.tensorrt.network import ConversionError, Extent, NetworkContext, is_tensor

KV_CACHE_UPDATE = "kv_cache_update"


@dataclasses.dataclass(frozen=True)
class KVWriteOutcome:
    """How one cache write was lowered.

    `aliased_input` names the network input the write's output aliases, or is
    None when the write fell back to a scatter for `fallback_reason`.
    """

    node_name: str
    cache_name: str
    aliased_input: str | None
    fallback_reason: str | None = None

    @property
    def aliased(self) -> bool:
        return self.aliased_input is not None


class _Declined(Exception):
    """The KV-cache-update layer cannot express this write; the message says why."""


def kv_write_alias_decline(write: fx.Node, constants: ConstantLookup) -> str | None:
    """Why the lowering would write the cache of KV write `write` as a copy, or None where it
    writes it in place, asked of the FX graph before lowering (what zerokv.executorch's export asks
    before it drops the write-back).

    The network's own checks come later and can still decline (a cache that is not a caller-owned
    input, or not the value written back): pass the caches relied on as `promised_aliases` to make
    that an error rather than a silent copy.
    """
    analysis = analyze_kv_write(write, constants=constants)
    if isinstance(analysis, DeclinedWrite):
        return analysis.reason
    return _static_shape_problem(analysis.op)


def _static_shape_problem(op: KVWriteOp) -> str | None:
    """`_kv_cache_update`'s shape checks, asked of FX metadata ahead of time."""
    cache, update = op.cache.meta["val"], op.update.meta["val"]
    if cache.dim() != 4 or update.dim() != 4:
        return f"cache and update of '{op.node.name}' must both be rank 4"
    for axis in (0, 1, 2, 3):
        if not isinstance(cache.shape[axis], int):
            return f"cache '{op.cache.name}' has a dynamic extent on axis {axis}"
    for axis in (0, 1, 3):
        if update.shape[axis] != cache.shape[axis]:
            return f"update of '{op.node.name}' disagrees with its cache on axis {axis}"
    return None


def convert_kv_write(
    ctx: NetworkContext,
    analysis: KVWriteAnalysis,
    cache_inputs: dict[str, str],
    written_back: bool,
) -> tuple[object, KVWriteOutcome]:
    """Lowers one cache write; returns the written cache and how it was lowered.

    Args:
      ctx: the network under construction; the write's operands are converted.
      analysis: the contiguity analysis of the write node.
      cache_inputs: placeholder name -> network input name, for every cache the
        caller owns (a mutated buffer or a mutated user input).
      written_back: whether the write's value is what the program writes back to
        the cache; only then can the engine's output be the cache itself.
    """
    op = analysis.op
    if op is None:
        # Not even decomposable into cache, update and positions: nothing we can write.
        raise ConversionError(analysis.node, f"the KV write cannot be lowered: {analysis.reason}")
    cache_name = op.cache.name
    if isinstance(analysis, ContiguousWrite):
        try:
            if not written_back:
                raise _Declined(
                    f"'{op.node.name}' is not the value written back to '{op.cache.name}' "
                    "(the cache is written again, or the write is not a mutation)"
                )
            written, input_name = _kv_cache_update(ctx, analysis, cache_inputs)
            return written, KVWriteOutcome(op.node.name, cache_name, input_name)
        except _Declined as declined:
            reason = f"KV-cache-update layer declined: {declined}"
    else:
        assert isinstance(analysis, DeclinedWrite)
        reason = f"positions not provably contiguous: {analysis.reason}"
    return _scatter(ctx, op), KVWriteOutcome(op.node.name, cache_name, None, reason)


def _kv_cache_update(ctx: NetworkContext, write: ContiguousWrite, cache_inputs: dict[str, str]):
    op = write.op
    input_name = cache_inputs.get(op.cache.name)
    if input_name is None:
        raise _Declined(
            f"cache '{op.cache.name}' is not a caller-owned network input, so there is no "
            "buffer to update in place"
        )
    cache = ctx.tensor(op.cache)
    if not cache.is_network_input:
        raise _Declined(f"cache '{op.cache.name}' reaches the layer as a computed tensor")
    update = ctx.tensor(op.update, _torch_dtype_of(op.cache))
    if len(cache.shape) != 4 or len(update.shape) != 4:
        raise _Declined(
            f"cache {tuple(cache.shape)} and update {tuple(update.shape)} must both be "
            "[batch, heads, positions, head_dim]"
        )
    if cache.shape[2] < 0:
        raise _Declined(f"the maximum sequence length of cache '{op.cache.name}' is not static")
    for axis, role in ((0, "batch"), (1, "heads"), (3, "head_dim")):
        if cache.shape[axis] < 0 or update.shape[axis] < 0:
            raise _Declined(
                f"{role} is not static in the network (cache {tuple(cache.shape)}, "
                f"update {tuple(update.shape)})"
            )
        if cache.shape[axis] != update.shape[axis]:
            raise _Declined(
                f"update {role} {update.shape[axis]} differs from cache {role} {cache.shape[axis]}"
            )
    write_indices = _start_positions(ctx, write, batch=cache.shape[0])
    layer = ctx.network.add_kv_cache_update(cache, update, write_indices, ctx.trt.KVCacheMode.LINEAR)
    ctx.name(layer, KV_CACHE_UPDATE)
    return layer.get_output(0), input_name


def _start_positions(ctx: NetworkContext, write: ContiguousWrite, batch: int):
    """The start position as the layer's writeIndices: int32 [batch], every row alike."""
    start = ctx.constant(torch.tensor([write.start.static_offset], dtype=torch.int64))
    for term in write.start.dynamic_terms:
        value = ctx.value(term)
        if isinstance(term.meta.get("val"), torch.Tensor):
            # A 0-d or [1]-shaped integer tensor, e.g. HF's cumulative length.
            term_tensor = ctx.flatten_scalar(ctx.cast(value, torch.int64))
        else:
            term_tensor = ctx.extent_tensor(value)
        start = ctx.elementwise(start, term_tensor, ctx.trt.ElementWiseOperation.SUM, torch.int64)
    # TensorRT-RTX accepts only int32 write indices.
    start = ctx.cast(start, torch.int32)
    return start if batch == 1 else ctx.broadcast_to(start, [batch])


def _scatter(ctx: NetworkContext, op: KVWriteOp):
    """`cache` with `update` written at the op's positions along its dimension."""
    cache = ctx.tensor(op.cache)
    rank = len(cache.shape)
    dim = op.dim + rank if op.dim < 0 else op.dim
    update = ctx.tensor(op.update, _torch_dtype_of(op.cache))
    if op.index is not None:
        positions = ctx.cast(ctx.tensor(op.index), torch.int64)
        if len(positions.shape) == 0:
            # aten's 0-d index writes one position; the update then lacks that axis.
            positions = ctx.flatten_scalar(positions)
            update_extents = ctx.extents(update)
            update_extents.insert(dim, 1)
            update = ctx.reshape(update, update_extents)
    else:
        start: Extent = ctx.value(op.slice_start) if op.slice_start is not None else 0
        step = op.slice_step
        if not isinstance(step, int):
            raise ConversionError(op.node, "the KV write slices with a non-static step")
        update = ctx.broadcast_to(update, _slice_extents(ctx, cache, update, dim))
        positions = ctx.arange(ctx.extent(update, dim), start, step)
    index_extents: list[Extent] = [1] * rank
    index_extents[dim] = -1
    update_extents = ctx.extents(update)
    indices = ctx.broadcast_to(ctx.reshape(positions, index_extents), update_extents)
    layer = ctx.network.add_scatter(cache, indices, update, ctx.trt.ScatterMode.ELEMENT)
    layer.axis = dim
    ctx.name(layer, "kv_scatter_fallback")
    return layer.get_output(0)


def _slice_extents(ctx: NetworkContext, cache, update, dim: int) -> list[Extent]:
    """The written region's extents: the cache's, with the update's along `dim`."""
    extents = ctx.extents(cache)
    update = ctx.unsqueeze_front(update, len(extents))
    extents[dim] = ctx.extent(update, dim)
    return extents


def _torch_dtype_of(node) -> torch.dtype:
    return node.meta["val"].dtype
