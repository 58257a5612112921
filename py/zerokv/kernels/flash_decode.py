"""Flash-decoding for one query token over a KV cache, split across the committed positions.

`torch.ops.zerokv.flash_decode(query, key, value, position, scale)` attends one new token per
sequence (`query` [B, H_q, 1, D]) to the positions 0..`position` of the caches (`key`, `value`
[B, H_kv, capacity, D], H_q a multiple of H_kv) and returns [B, 1, H_q, D], the layout a decoder's
output projection reads. `position` is one integer on the device, the same for every sequence: a
position past the capacity attends to the whole capacity, and a negative one gives NaN (nothing is
committed). It is a `torch.library.triton_op`, so AOTInductor compiles its two kernels into the
engine like its own.

Why not ExecuTorch's split-K decode kernel (`triton::sdpa_decode_splitk`), which this replaces:
its chunk of positions per thread block is a launch argument sized from the capacity. A decode
step captured as a CUDA graph replays that argument at every position, so over a static cache of
32768 positions each block owns 256 of them and, at position 4096, 16 of its 128 splits have work.
Here the split is computed on the device from the committed length, so the committed positions are
spread over the splits (down to one tile of BLOCK_N positions each) at every position. Its kv_len
path also reads the capacity as a Python int, which specializes an engine over runtime-owned caches
(a dynamic capacity) to one capacity; here the capacity is a kernel argument and the committed
length is bounded by it on the device, so one engine serves every capacity and never reads past it.

The sweep: each (split, sequence, KV head) program reads its chunk of K and V once for all the
query heads that share them (grouped-query attention), keeping a running maximum, sum and weighted
sum of V (online softmax) in float32; a second kernel combines the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction

from zerokv.kernels import dependent_launch
from zerokv.kernels.grid_dependency import wait_for_the_kernel_before
from zerokv.kernels.flash_decode_contract import DTYPES, MIN_DOT_SIZE, FlashDecodeError, head_dim_problem

# Positions a program reads per step of its sweep; a chunk is a whole number of them.
BLOCK_N = 64
# Thread blocks to aim for per streaming multiprocessor: enough to hide memory latency. On the H200,
# 4 (64 splits over Llama-3.2-1B's 8 KV heads) read 16384 positions in 14.8 us per layer, 2 (32
# splits) in 19.6 (//tools/bench:flash_decode_bench); 8 (128 splits) made the 1B step 1-3% slower
# at most positions (tools/bench/results/h200/balanced_tiles_ab_9c9a669.md).
BLOCKS_PER_SM = 4
MAX_SPLITS = 128
# Tiles of a split's sweep in flight at once: Triton pipelines the tl.range loop, issuing the next
# tiles' loads before this one's arithmetic. In three alternating A/Bs of the 1B decode step on the
# H200, 3 against 1 (the while loop) made the static step 0.6-2.9% faster (medians over the calls)
# and the bare engine 2.2% faster at 16384, with no consistent difference up to 8192
# (tools/bench/results/h200/pipelined_sweep_ab_1839272.md).
STAGES = 3


@triton.jit
def _attend_tile(q, k_base, v_base, tile, end, dims, stride_kn, stride_kd, stride_vn, stride_vd, scale,
                 running_max, running_sum, weighted, BLOCK_N: tl.constexpr):
    """The online softmax over one tile of positions from `tile` (below `end`, so the tile's
    maximum is finite and no exp sees -inf - -inf): the running maximum, sum and weighted sum of V."""
    positions = tile + tl.arange(0, BLOCK_N)
    inside = positions < end
    k = tl.load(k_base + positions[:, None] * stride_kn + dims[None, :] * stride_kd,
                mask=inside[:, None], other=0.0)
    # In float32 whatever `scale` arrives as (Inductor passes a Python float as float64).
    scores = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)
    scores = tl.where(inside[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    weights = tl.exp(scores - new_max[:, None])
    rescale = tl.exp(running_max - new_max)
    v = tl.load(v_base + positions[:, None] * stride_vn + dims[None, :] * stride_vd,
                mask=inside[:, None], other=0.0)
    weighted = weighted * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
    running_sum = running_sum * rescale + tl.sum(weights, axis=1)
    return new_max, running_sum, weighted


@triton.jit
def _split_kernel(Q, K, V, partial_out, partial_max, partial_sum, Position, capacity, kv_heads,
                  stride_qb, stride_qh, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  scale,
                  SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
                  STAGES: tl.constexpr):
    # Everything this kernel reads may be written by the kernels before it (the query, the caches'
    # new position): it waits before anything (zerokv.kernels.dependent_launch).
    if DEPENDENT_LAUNCH:
        after_the_wait = wait_for_the_kernel_before()
        Q += after_the_wait
        K += after_the_wait
        V += after_the_wait
        Position += after_the_wait
    split = tl.program_id(0)
    sequence = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads

    # Bounded before narrowing, so that no position wraps into the capacity.
    committed = tl.minimum(tl.load(Position), capacity - 1).to(tl.int32) + 1
    # The committed tiles are dealt out one by one, the first `extra` splits taking one more: in
    # chunks of whole tiles, 65 tiles for 64 splits made chunks of 2 and left 31 splits idle.
    tiles = tl.cdiv(tl.maximum(committed, 0), BLOCK_N)
    share = tiles // SPLITS
    extra = tiles % SPLITS
    start = (split * share + tl.minimum(split, extra)) * BLOCK_N
    end = tl.minimum(start + (share + (split < extra).to(tl.int32)) * BLOCK_N, committed)

    heads = tl.arange(0, BLOCK_G)
    real_heads = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    query_heads = kv_head * GROUP + heads
    q = tl.load(Q + sequence * stride_qb + query_heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=real_heads[:, None], other=0.0)

    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    weighted = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    # In 64 bits: a batch of long caches passes 2**31 elements.
    k_base = K + sequence.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + sequence.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    # The sweep's tiles wait on memory one after another unless Triton pipelines the loop
    # (STAGES > 1: the next tiles' loads issued before this one's arithmetic). STAGES 1 keeps the
    # while loop that the roofline table (9c9a669) and the A/Bs' baselines ran: a one-stage
    # tl.range compiles to other instructions.
    if STAGES > 1:
        for tile in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            running_max, running_sum, weighted = _attend_tile(
                q, k_base, v_base, tile, end, dims, stride_kn, stride_kd, stride_vn, stride_vd, scale,
                running_max, running_sum, weighted, BLOCK_N)
    else:
        tile = start
        while tile < end:
            running_max, running_sum, weighted = _attend_tile(
                q, k_base, v_base, tile, end, dims, stride_kn, stride_kd, stride_vn, stride_vd, scale,
                running_max, running_sum, weighted, BLOCK_N)
            tile += BLOCK_N

    # A split past the committed length stores max -inf and sum 0: the combine weighs it 0. The
    # padding heads (up to BLOCK_G) are not stored: the combine reads real heads only.
    row = (split * tl.num_programs(1) + tl.program_id(1)) * BLOCK_G + heads
    tl.store(partial_max + row, running_max, mask=real_heads)
    tl.store(partial_sum + row, running_sum, mask=real_heads)
    tl.store(partial_out + row[:, None] * HEAD_DIM + dims[None, :], weighted, mask=real_heads[:, None])


@triton.jit
def _combine_kernel(partial_out, partial_max, partial_sum, Out, kv_heads,
                    stride_ob, stride_oh, stride_od,
                    SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                    HEAD_DIM: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    if DEPENDENT_LAUNCH:
        after_the_wait = wait_for_the_kernel_before()
        partial_out += after_the_wait
        partial_max += after_the_wait
        partial_sum += after_the_wait
    sequence_head = tl.program_id(0)  # one program per (sequence, query head)
    sequence = sequence_head // (kv_heads * GROUP)
    head = sequence_head % (kv_heads * GROUP)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    # Rows are (split, sequence, KV head, padded group member), as the split kernel stores them.
    sequences = tl.num_programs(0) // (kv_heads * GROUP)
    row = ((splits * sequences + sequence) * kv_heads + head // GROUP) * BLOCK_G + head % GROUP
    maxima = tl.load(partial_max + row)
    overall = tl.max(maxima, axis=0)  # finite: split 0 always holds position 0
    weights = tl.exp(maxima - overall)
    total = tl.sum(tl.load(partial_sum + row) * weights, axis=0)
    out = tl.sum(tl.load(partial_out + row[:, None] * HEAD_DIM + dims[None, :]) * weights[:, None], axis=0)
    tl.store(Out + sequence * stride_ob + head * stride_oh + dims * stride_od,
             (out / total).to(Out.dtype.element_ty))


# Triton's interpreter (TRITON_INTERPRET=1 when the kernels were defined) runs them on CPU tensors.
INTERPRETED = isinstance(_split_kernel, InterpretedFunction)


def check_inputs(query, key, value, position):
    """Raises FlashDecodeError naming what the kernels cannot take."""
    problems = []
    if query.dim() != 4 or query.shape[2] != 1:
        problems.append(f"query: one token per sequence, [B, H_q, 1, D], not {list(query.shape)}")
    elif key.dim() != 4 or key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        problems.append(f"key's shape {list(key.shape)} is not [B, H_kv, capacity, D] for query {list(query.shape)}")
    elif key.shape[1] == 0 or key.shape[2] == 0:
        problems.append(f"key's shape {list(key.shape)} has no heads or no positions")
    elif query.shape[1] % key.shape[1]:
        problems.append(f"{query.shape[1]} query heads are not a multiple of key's {key.shape[1]}")
    if value.shape != key.shape:
        problems.append(f"value's shape {list(value.shape)} is not key's {list(key.shape)}")
    if query.dtype not in DTYPES:
        problems.append(f"query is {query.dtype}; the kernels take {' or '.join(map(str, DTYPES))}")
    for name, tensor in (("key", key), ("value", value), ("position", position)):
        if tensor.device != query.device:
            problems.append(f"{name} is on {tensor.device}, query on {query.device}")
        if name != "position" and tensor.dtype != query.dtype:
            problems.append(f"{name} is {tensor.dtype}, query {query.dtype}")
    if problem := head_dim_problem(query.shape[-1]):
        problems.append(problem)
    if position.numel() != 1 or position.dtype.is_floating_point or position.dtype.is_complex \
            or position.dtype == torch.bool:
        problems.append(f"position must be one integer (the step's), not {position.dtype} {list(position.shape)}")
    if problems:
        raise FlashDecodeError("flash_decode: " + "; ".join(problems))


def splits_for(sequences_times_kv_heads: int, multiprocessors: int) -> int:
    """The number of splits (a power of two, for the combine's vector) that gives each
    multiprocessor about BLOCKS_PER_SM programs."""
    wanted = max(1, BLOCKS_PER_SM * multiprocessors // max(1, sequences_times_kv_heads))
    return min(MAX_SPLITS, 1 << (wanted.bit_length() - 1))


def launch(query, key, value, position, scale, out, splits, block_n=BLOCK_N, num_warps=4, stages=STAGES,
           launcher=lambda kernel: kernel):
    """Runs the two kernels into `out` ([B, 1, H_q, D]). `launcher` wraps each kernel
    (`wrap_triton` when traced); //tools/bench:flash_decode_bench sweeps `block_n`, `num_warps` and
    `stages`."""
    if stages < 1:
        raise FlashDecodeError(f"flash_decode: {stages} stages; the sweep takes 1 or more")
    if splits < 1 or splits & (splits - 1):
        raise FlashDecodeError(f"flash_decode: {splits} splits; the combine takes a power of two")
    if block_n < MIN_DOT_SIZE or block_n & (block_n - 1):
        raise FlashDecodeError(f"flash_decode: block_n {block_n}; a tile is a power of two of {MIN_DOT_SIZE} or more")
    batch, query_heads, _, head_dim = query.shape
    kv_heads, capacity = key.shape[1], key.shape[2]
    group = query_heads // kv_heads
    block_g = max(MIN_DOT_SIZE, triton.next_power_of_2(group))
    dependent = dependent_launch.supported(query.device)
    rows = splits * batch * kv_heads * block_g
    partial_out = torch.empty((rows, head_dim), device=query.device, dtype=torch.float32)
    partial_max = torch.empty((rows,), device=query.device, dtype=torch.float32)
    partial_sum = torch.empty((rows,), device=query.device, dtype=torch.float32)
    launcher(_split_kernel)[(splits, batch * kv_heads)](
        query, key, value, partial_out, partial_max, partial_sum, position, capacity, kv_heads,
        query.stride(0), query.stride(1), query.stride(3),
        *key.stride(), *value.stride(), scale,
        SPLITS=splits, GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n, HEAD_DIM=head_dim,
        DEPENDENT_LAUNCH=dependent, STAGES=stages, num_warps=num_warps)
    launcher(_combine_kernel)[(batch * query_heads,)](
        partial_out, partial_max, partial_sum, out, kv_heads,
        out.stride(0), out.stride(2), out.stride(3),
        SPLITS=splits, GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim,
        DEPENDENT_LAUNCH=dependent, num_warps=1)
    return out


def _multiprocessors(device):
    """The device's streaming multiprocessors; the interpreter runs one program at a time."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if INTERPRETED:
        return 1
    raise FlashDecodeError(f"flash_decode: the kernels run on CUDA devices, or on the CPU under Triton's "
                           f"interpreter (TRITON_INTERPRET=1 before they are imported); not on {device}")


@triton_op("zerokv::flash_decode", mutates_args=())
def flash_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor,
                 scale: float) -> torch.Tensor:
    check_inputs(query, key, value, position)
    batch, query_heads, _, head_dim = query.shape
    out = torch.empty((batch, 1, query_heads, head_dim), device=query.device, dtype=query.dtype)
    return launch(query, key, value, position, scale, out,
                  splits_for(batch * key.shape[1], _multiprocessors(query.device)), launcher=wrap_triton)


# triton_op's own fake runs the launch, which asks the device for its multiprocessors: an export
# on the CPU (decode_roofline_programs.py) compiles for CUDA from CPU tensors.
@flash_decode.register_fake
def _(query, key, value, position, scale):
    check_inputs(query, key, value, position)
    batch, query_heads, _, head_dim = query.shape
    return query.new_empty((batch, 1, query_heads, head_dim))
