// The persistent decode-step kernel of llama_decode_step.h.
//
// Each CTA (one per SM) runs a producer warp and kConsumerWarps consumer warps. Both walk the same
// schedule (ForEachTile). The producer copies each tile into the next slot of a ring in shared
// memory and never waits for activations; the consumers wait for each stage's inputs at a grid
// barrier, then take the tiles in the same order. Numerics follow transformers' BF16 Llama: every
// tensor the model keeps in BF16 (residual stream, projections, rotary products, attention output)
// is rounded to BF16 where the model rounds it; sums accumulate in FP32.
#include "cc/engines/megakernel/llama_decode_step.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace zerokv::engines::megakernel {
namespace {

constexpr int kConsumerWarps = 16;
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kProducerWarp = kConsumerWarps;
// A product's tile: kTileRows rows (an m16n8k16's m) by kSegment columns, each row its own bulk
// copy, kRowPitch bytes apart so that the two rows a quarter-warp reads fall in different banks.
constexpr int kTileRows = 16;
constexpr int kRowBytes = kSegment * 2;
constexpr int kRowPitch = kRowBytes + 64;
constexpr int kTileBytes = kTileRows * kRowPitch;  // a slot of the ring
// A consumer warp's columns of every tile: 4 lanes of 8 (one 16-byte load a row).
constexpr int kWarpColumns = kSegment / kConsumerWarps;
static_assert(kWarpColumns == 4 * 8 && kTileRows <= 32, "ConsumeSlice's fragment layout; a producer lane a row");
#ifndef ZEROKV_MEGAKERNEL_RING
#define ZEROKV_MEGAKERNEL_RING 6
#endif
// 96 KiB in flight per SM: the ~35 KiB that keeps an SM's share of HBM busy, about three times over.
// Measured on the H100 (megakernel_profile.py), 6 was as fast as 10 or a little faster, and 4 close
// (with slots of 16 KiB; ten of 17 KiB no longer fit beside the LM head's dot products).
constexpr int kRing = ZEROKV_MEGAKERNEL_RING;
constexpr int kAttnTile = 64;   // positions per attention tile: K rows, then V rows at kValueOffset
constexpr int kValueOffset = kAttnTile * kHeadDim * 2;
static_assert(2 * kValueOffset <= kTileBytes, "an attention tile fits a slot");
constexpr int kMaxSplits = 32;  // attention work items per KV head, at most
// Attention on tensor cores: a warp folds kWarpPositions positions of a tile (one mma's n), so the
// consumers split in two groups of warps that take alternate tiles, each warp its block of a tile.
constexpr int kWarpPositions = 8;
constexpr int kAttentionGroups = kConsumerWarps * kWarpPositions / kAttnTile;
static_assert(kAttentionGroups == 2 && kHeadDim == 64 && kGroup == 4, "AttendTile's fragment layout");
#ifndef ZEROKV_MEGAKERNEL_SPLIT_TILES
#define ZEROKV_MEGAKERNEL_SPLIT_TILES 1
#endif
// Attention tiles per work item, at least. One, measured on the H100 against 4 and 8: a split's
// merge (two round trips to L2) costs less than a tile more on the slowest CTA.
constexpr int kMinSplitTiles = ZEROKV_MEGAKERNEL_SPLIT_TILES;
constexpr int kStagesPerLayer = 5;

template <class T>
__host__ __device__ constexpr T Min(T a, T b) { return a < b ? a : b; }
template <class T>
__host__ __device__ constexpr T Max(T a, T b) { return a < b ? b : a; }
__host__ __device__ inline size_t Span(int rows, int columns) { return static_cast<size_t>(rows) * columns; }

__host__ __device__ inline size_t Align(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
__host__ __device__ inline int CeilDiv(int a, int b) { return (a + b - 1) / b; }

__host__ __device__ inline int QkvRows(const LlamaShape& s) { return (s.heads + 2 * s.kv_heads) * s.head_dim; }

struct Workspace {
  size_t x, qkv, attn, h, part_o, part_m, part_l, head_count, arrivals, bytes;
};

__host__ __device__ inline Workspace WorkspaceLayout(const LlamaShape& s) {
  Workspace w{};
  size_t at = 0;
  auto take = [&](size_t bytes) { const size_t here = at; at += Align(bytes); return here; };
  w.x = take(sizeof(float) * s.hidden);
  w.qkv = take(sizeof(float) * QkvRows(s));
  w.attn = take(sizeof(float) * s.heads * s.head_dim);
  w.h = take(sizeof(float) * s.ffn);
  w.part_o = take(sizeof(float) * s.kv_heads * kMaxSplits * kGroup * kHeadDim);
  w.part_m = take(sizeof(float) * s.kv_heads * kMaxSplits * kGroup);
  w.part_l = take(sizeof(float) * s.kv_heads * kMaxSplits * kGroup);
  w.head_count = take(sizeof(uint32_t) * s.kv_heads);
  w.arrivals = take(sizeof(uint64_t));
  w.bytes = at;
  return w;
}

// A stage's dot products in shared memory, at most, over every stage: a row's per consumer warp.
__host__ __device__ inline int MaxDotsPerCta(const LlamaShape& s, int ctas) {
  int rows = Max(CeilDiv(QkvRows(s), ctas), CeilDiv(s.hidden, ctas));
  rows = Max(rows, 2 * CeilDiv(s.ffn, ctas));
  return kConsumerWarps * Max(rows, CeilDiv(s.vocab, ctas));
}

__host__ __device__ inline int MaxInput(const LlamaShape& s) {
  return Max(Max(s.hidden, s.ffn), s.heads * s.head_dim);
}

struct Shared {
  size_t full, empty, input, dots, residual, q, cos_sin, stats, new_kv, reduce, bytes;
};

__host__ __device__ inline Shared SharedLayout(const LlamaShape& s, int ctas) {
  Shared m{};
  size_t at = size_t{kRing} * kTileBytes;
  auto take = [&](size_t bytes) { const size_t here = at; at += (bytes + 127) & ~size_t{127}; return here; };
  m.full = take(sizeof(uint64_t) * kRing);
  m.empty = take(sizeof(uint64_t) * kRing);
  // A product's input (BF16), or attention's per-warp outputs (FP32).
  m.input = take(Max(sizeof(__nv_bfloat16) * MaxInput(s), sizeof(float) * kConsumerWarps * kGroup * kHeadDim));
  m.dots = take(sizeof(float) * MaxDotsPerCta(s, ctas));
  m.residual = take(sizeof(float) * CeilDiv(s.hidden, ctas));
  m.q = take(sizeof(float) * kGroup * kHeadDim);
  m.cos_sin = take(sizeof(float) * kHeadDim);
  m.stats = take(sizeof(float) * 2 * kConsumerWarps * kGroup);  // attention's maxes and sums
  m.new_kv = take(sizeof(__nv_bfloat16) * 2 * kHeadDim);
  m.reduce = take(sizeof(float) * (kConsumerWarps + 1));
  m.bytes = at;
  return m;
}

// The CTA's rows [begin, end) of an `n`-row stage. The assignment turns with (layer, stage) so that
// the CTAs that get one row more differ from stage to stage and every CTA streams about as much.
struct Rows {
  int begin, end;
};
__device__ inline Rows RowsOf(int n, int layer, int stage) {
  const int ctas = gridDim.x;
  const int v = (blockIdx.x + (layer * kStagesPerLayer + stage) * 37) % ctas;
  return {static_cast<int>(int64_t{v} * n / ctas), static_cast<int>(int64_t{v + 1} * n / ctas)};
}

// The attention work of a CTA: KV head `head`, positions [begin, end) of the cache, and this step's
// own K and V when `last` (the last split of the head). `head` < 0: no attention work.
struct AttentionItem {
  int head, split, splits, begin, end;
  bool last;
};
__device__ inline AttentionItem AttentionItemOf(const LlamaShape& s, int position) {
  const int max_splits = Min(kMaxSplits, static_cast<int>(gridDim.x) / s.kv_heads);
  const int splits = Max(1, Min(max_splits, CeilDiv(position, kAttnTile * kMinSplitTiles)));
  const int chunk = CeilDiv(CeilDiv(Max(position, 1), splits), kAttnTile) * kAttnTile;
  const int c = blockIdx.x;
  if (c >= splits * s.kv_heads) return {-1, 0, splits, 0, 0, false};
  const int split = c % splits;
  const int begin = Min(position, split * chunk);
  const int end = Min(position, begin + chunk);
  return {c / splits, split, splits, begin, end, split == splits - 1};
}

// --- shared-memory pipeline (mbarrier and bulk copy) ---

__device__ inline uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ inline void BarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(bar)), "r"(count) : "memory");
}
__device__ inline void ArriveExpectBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)), "r"(bytes)
               : "memory");
}
__device__ inline void Arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SharedAddress(bar)) : "memory");
}
__device__ inline void WaitParity(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(SharedAddress(bar)),
      "r"(parity)
      : "memory");
}
__device__ inline uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ inline void BulkCopy(void* dst, const void* src, uint32_t bytes, uint64_t* bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar)), "l"(policy)
      : "memory");
}
__device__ inline void BulkCopy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   SharedAddress(dst)),
               "l"(src), "r"(bytes), "r"(SharedAddress(bar))
               : "memory");
}

enum TraceField { kArriveNs, kLeaveNs, kArriveClock, kLeaveClock, kStarved, kBlocked, kInputClock, kTilesClock, kTraceFields };
#ifdef ZEROKV_MEGAKERNEL_TRACE
// Diagnostics (megakernel_profile.py builds with it), per CTA and barrier: the global time and the
// SM's clock at the barrier's arrival and departure; the cycles the first consumer thread waited for
// tiles in the stage before it (the stream behind the consumers); the cycles the producer waited
// for a free slot while it copied that stage's tiles (the consumers behind the stream); the first
// consumer thread's clock when the stage's input was in shared memory and when it had taken the
// stage's last tile (what comes before the tiles, and after them).
constexpr int kTraceBarriers = kMaxLayers * kStagesPerLayer;
constexpr int kTraceCtas = 256;
__device__ uint64_t g_trace[kTraceCtas][kTraceBarriers][kTraceFields];
__device__ int g_trace_at[kTraceCtas];
__device__ uint64_t g_waited[kTraceCtas][2];  // cycles since the last record: consumer thread 0's, the producer's
__device__ inline uint64_t GlobalTime() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ inline uint64_t TakeWaited(int who) {
  const uint64_t cycles = g_waited[blockIdx.x][who];
  g_waited[blockIdx.x][who] = 0;
  return cycles;
}
#endif

// Under the trace, the first consumer thread's clock as `field` of the stage it is in.
__device__ inline void TraceMark([[maybe_unused]] TraceField field) {
#ifdef ZEROKV_MEGAKERNEL_TRACE
  const int at = g_trace_at[blockIdx.x];
  if (threadIdx.x == 0 && at < kTraceBarriers) g_trace[blockIdx.x][at][field] = clock64();
#endif
}

// A wait on a slot of the ring (timed under the trace).
__device__ inline void WaitSlot(uint64_t* bar, uint32_t parity) {
#ifdef ZEROKV_MEGAKERNEL_TRACE
  const uint64_t began = clock64();
  WaitParity(bar, parity);
  if (threadIdx.x == 0 || threadIdx.x == kConsumerThreads) {
    g_waited[blockIdx.x][threadIdx.x == 0 ? 0 : 1] += clock64() - began;
  }
#else
  WaitParity(bar, parity);
#endif
}

struct Ring {
  unsigned char* tiles;
  uint64_t* full;
  uint64_t* empty;
  uint32_t count;  // tiles taken (consumers) or issued (producer) so far

  __device__ unsigned char* tile() const { return tiles + (count % kRing) * kTileBytes; }
  __device__ uint64_t* full_bar() const { return full + count % kRing; }
  __device__ uint64_t* empty_bar() const { return empty + count % kRing; }
  __device__ uint32_t parity() const { return (count / kRing) & 1; }
};

// A consumer warp's release of the slot it has loaded its part of, to be refilled while the warp
// computes. The producer's copy writes the slot through the async proxy, which the arrival's
// release does not order after the warp's loads: without the proxy fence the copy may land before
// a load has read the slot (seen on an H100 as different bits from the same inputs).
__device__ inline void ReleaseSlot(Ring& ring) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if (threadIdx.x % 32 == 0) Arrive(ring.empty_bar());
  ++ring.count;
}

// One tile of the step's stream: `rows` rows of kSegment columns of a product from `first`, `stride`
// elements apart, or for attention `bytes` of K rows from `first` and as many V rows from `second`
// (at kValueOffset in the tile).
struct TileSource {
  const __nv_bfloat16* first;
  const __nv_bfloat16* second;
  uint32_t bytes;
  int rows, stride;
};

// Calls `tile(TileSource)` for every tile of the step in the order the consumers take them, and
// `staged(layer, stage)` after each stage of a layer: the CTA's rows of qkv, its attention work
// item's K and V, its rows of o, gate, up and down, then its rows of the LM head. A product's rows
// come kTileRows at a time, each group's column blocks in order.
template <class Tile, class Staged>
__device__ void ForEachTile(const LlamaDecodeArgs& a, int position, Tile&& tile, Staged&& staged) {
  const LlamaShape& s = a.shape;
  auto slice = [&](const __nv_bfloat16* matrix, Rows r, int k) {
    for (int row = r.begin; row < r.end; row += kTileRows) {
      for (int column = 0; column < k; column += kSegment) {
        tile(TileSource{matrix + Span(row, k) + column, nullptr, 0, Min(kTileRows, r.end - row), k});
      }
    }
  };
  const AttentionItem item = AttentionItemOf(s, position);
  const int attn_width = s.heads * s.head_dim;
  for (int l = 0; l < s.layers; ++l) {
    const LlamaLayer& layer = a.layer[l];
    slice(layer.qkv, RowsOf(QkvRows(s), l, 0), s.hidden);
    staged(l, 0);
    if (item.head >= 0) {
      const size_t head_rows = Span(item.head, s.capacity);
      for (int p = item.begin; p < item.end; p += kAttnTile) {
        const size_t at = (head_rows + p) * kHeadDim;
        tile(TileSource{layer.k_cache + at, layer.v_cache + at,
                        static_cast<uint32_t>(Min(kAttnTile, item.end - p) * kHeadDim * 2), 0, 0});
      }
    }
    staged(l, 1);
    slice(layer.o, RowsOf(s.hidden, l, 2), attn_width);
    staged(l, 2);
    const Rows ffn_rows = RowsOf(s.ffn, l, 3);
    slice(layer.gate, ffn_rows, s.hidden);
    slice(layer.up, ffn_rows, s.hidden);
    staged(l, 3);
    slice(layer.down, RowsOf(s.hidden, l, 4), s.ffn);
    staged(l, 4);
  }
  slice(a.lm_head, RowsOf(s.vocab, s.layers, 0), s.hidden);
}

// Under the trace, the cycles the producer waited for free slots while copying stage `stage` of
// layer `layer`.
__device__ inline void TraceProduced([[maybe_unused]] int layer, [[maybe_unused]] int stage) {
#ifdef ZEROKV_MEGAKERNEL_TRACE
  const int at = layer * kStagesPerLayer + stage;
  if (threadIdx.x == kConsumerThreads && at < kTraceBarriers) g_trace[blockIdx.x][at][kBlocked] = TakeWaited(1);
#endif
}

// The producer warp: lane 0 arms each slot's barrier and lane r copies a product tile's row r.
__device__ void Produce(const LlamaDecodeArgs& a, Ring ring, int position) {
  const int lane = threadIdx.x % 32;
  const uint64_t policy = EvictFirstPolicy();
  ForEachTile(
      a, position,
      [&](const TileSource& t) {
        WaitSlot(ring.empty_bar(), ring.parity() ^ 1);
        if (t.second == nullptr) {
          if (lane == 0) ArriveExpectBytes(ring.full_bar(), t.rows * kRowBytes);
          __syncwarp();
          if (lane < t.rows) {
            BulkCopy(ring.tile() + lane * kRowPitch, t.first + Span(lane, t.stride), kRowBytes, ring.full_bar(), policy);
          }
        } else if (lane == 0) {
          ArriveExpectBytes(ring.full_bar(), 2 * t.bytes);
          BulkCopy(ring.tile(), t.first, t.bytes, ring.full_bar());
          BulkCopy(ring.tile() + kValueOffset, t.second, t.bytes, ring.full_bar());
        }
        ++ring.count;
      },
      TraceProduced);
}

// --- consumers ---

__device__ inline void ConsumerSync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory"); }

__device__ inline float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float Bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ inline float Load(const float* p) { return __ldcg(p); }  // written by other CTAs this step

__device__ inline uint64_t LoadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline uint32_t AddAcquireRelease(uint32_t* p, uint32_t v) {
  uint32_t before;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(before) : "l"(p), "r"(v) : "memory");
  return before;
}
__device__ inline void AddRelease(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The grid barrier: every CTA's consumers reach it before any passes. `arrivals` only grows, by one
// per CTA at each barrier, so that nothing resets it. Every step passes the same number of
// barriers, so the count when a CTA starts, rounded down to a whole step's arrivals, is where the
// step's count starts (no CTA passes the step's first barrier before every CTA has read it), and
// the k-th barrier opens at that plus k times the grid. An arrival is then a release that nothing
// waits for, and the barrier's latency one round trip to L2 after the last arrival's reduction.
class GridBarrier {
 public:
  __device__ GridBarrier(uint64_t* arrivals, int per_step) : arrivals_(arrivals) {
    if (threadIdx.x == 0) {
      const uint64_t step = static_cast<uint64_t>(per_step) * gridDim.x;
      opens_ = LoadAcquire(arrivals) / step * step;
    }
  }

  __device__ __forceinline__ void Sync() {
    ConsumerSync();
#ifdef ZEROKV_MEGAKERNEL_TRACE
    const int at = g_trace_at[blockIdx.x];
    if (threadIdx.x == 0 && at < kTraceBarriers) {
      uint64_t* record = g_trace[blockIdx.x][at];
      record[kArriveNs] = GlobalTime();
      record[kArriveClock] = clock64();
      record[kStarved] = TakeWaited(0);
    }
#endif
#ifdef ZEROKV_MEGAKERNEL_NO_GRID_SYNC
    if (false) {
#else
    if (threadIdx.x == 0) {
#endif
      opens_ += gridDim.x;
      AddRelease(arrivals_, 1);
      while (LoadAcquire(arrivals_) < opens_) {
      }
    }
    ConsumerSync();
#ifdef ZEROKV_MEGAKERNEL_TRACE
    if (threadIdx.x == 0 && at < kTraceBarriers) {
      g_trace[blockIdx.x][at][kLeaveNs] = GlobalTime();
      g_trace[blockIdx.x][at][kLeaveClock] = clock64();
      g_trace_at[blockIdx.x] = at + 1;
    }
#endif
  }

 private:
  uint64_t* const arrivals_;
  uint64_t opens_ = 0;  // thread 0's
};

// D = A B + D on tensor cores, BF16 in and FP32 out: m16n8k16 and m16n8k8 (PTX's fragment layouts).
__device__ inline void Mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ inline void Mma1688(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// A product's dot products in shared memory, by consumer warp: at[w * rows + row] is row `row`'s
// over warp w's columns. Each (warp, row) is written once: no zeroing and no atomics, and a row's
// parts are summed in one order.
struct Dots {
  float* at;
  int rows;

  __device__ float Row(int row) const {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) sum += at[w * rows + row];
    return sum;
  }
};

// The dots of `dots.rows` rows of a `k`-wide product with `input` (BF16 in shared memory), arriving
// as ForEachTile's tiles. A warp takes kWarpColumns columns of each tile, all its rows, as two
// m16n8k16 products whose A is the rows and whose B is the input in column 0 (lanes 0-3; the rest
// zero): the tensor cores accumulate over the columns, so a tile costs no shuffle. The products'
// k index is a permutation of the columns (a dot product's order is free) that makes each lane's
// part of a row one 16-byte load: lane (g, t) = (lane / 4, lane % 4) reads columns [8t, 8t + 8) of
// the warp's, of rows g and g + 8, and lanes 0-3 the same columns of the input. Column 0 of the
// result, rows g and g + 8, is then in lane 4g's registers 0 and 2. A last group's rows past the
// product's hold whatever the slot held before, which reaches only those rows of the result.
__device__ void ConsumeSlice(Ring& ring, const Dots& dots, const __nv_bfloat16* input, int k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2;
  const int column = warp * kWarpColumns + 8 * (lane & 3);
  for (int first = 0; first < dots.rows; first += kTileRows) {
    float even[4] = {}, odd[4] = {};  // two accumulators, so that the products do not wait for each other
    for (int block = 0; block < k; block += kSegment) {
      WaitSlot(ring.full_bar(), ring.parity());
      const unsigned char* rows = ring.tile() + column * 2;
      const uint4 low = *reinterpret_cast<const uint4*>(rows + g * kRowPitch);
      const uint4 high = *reinterpret_cast<const uint4*>(rows + (g + 8) * kRowPitch);
      const uint4 x = lane < 4 ? *reinterpret_cast<const uint4*>(input + block + column) : make_uint4(0, 0, 0, 0);
      ReleaseSlot(ring);  // the producer refills it during the arithmetic
      Mma16816(even, low.x, high.x, low.y, high.y, x.x, x.y);
      Mma16816(odd, low.z, high.z, low.w, high.w, x.z, x.w);
    }
    if ((lane & 3) == 0) {
      if (first + g < dots.rows) dots.at[warp * dots.rows + first + g] = even[0] + odd[0];
      if (first + g + 8 < dots.rows) dots.at[warp * dots.rows + first + g + 8] = even[2] + odd[2];
    }
  }
}

// input = RMSNorm(x) * weight, rounded as transformers' LlamaRMSNorm rounds it. `x` is the residual
// stream, or null for the embedding row (the first layer's input). Both hold BF16 values, so the
// BF16 input keeps them exactly.
__device__ void LoadNormed(__nv_bfloat16* input, const float* x, const __nv_bfloat16* embedding_row,
                           const __nv_bfloat16* weight, int n, float eps, float* reduce) {
  float squares = 0.f;
  for (int i = threadIdx.x; i < n; i += kConsumerThreads) {
    const float v = x ? Load(x + i) : __bfloat162float(embedding_row[i]);
    input[i] = __float2bfloat16(v);
    squares += v * v;
  }
  squares = WarpSum(squares);
  if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = squares;
  ConsumerSync();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kConsumerWarps; ++w) total += reduce[w];
  const float scale = rsqrtf(total / n + eps);
  for (int i = threadIdx.x; i < n; i += kConsumerThreads) {
    input[i] = __float2bfloat16(Bf16(__bfloat162float(input[i]) * scale) * __bfloat162float(weight[i]));
  }
  ConsumerSync();
}

// The residual stream's `rows`, or the embedding row's when `x` is null (the first layer's), read
// at a stage's start so that the wait for them overlaps the stage's input's.
__device__ inline void LoadResidual(float* residual, const float* x, const __nv_bfloat16* embedding_row, Rows rows) {
  for (int i = threadIdx.x; i < rows.end - rows.begin; i += kConsumerThreads) {
    residual[i] = x ? Load(x + rows.begin + i) : __bfloat162float(embedding_row[rows.begin + i]);
  }
}

// `n` values of a BF16 tensor that the step keeps in FP32, as a product's input.
__device__ inline void LoadVector(__nv_bfloat16* input, const float* v, int n) {
  for (int i = threadIdx.x; i < n; i += kConsumerThreads) input[i] = __float2bfloat16(Load(v + i));
  ConsumerSync();
}

struct AttentionShared {
  float* q;        // [kGroup, kHeadDim], rotated and scaled
  float* cos_sin;  // [kHeadDim]: cos and sin of the position's angles, interleaved
  float* max;      // [kConsumerWarps, kGroup]: each warp's running max
  float* sum;      // [kConsumerWarps, kGroup]: each warp's running sum
  float* out;      // [kConsumerWarps, kGroup * kHeadDim]: each warp's output (the input buffer, free here)
};

// The weight of a running softmax with max `m` in a merge whose max is `merged`: 0 for one that has
// seen no row (-inf - -inf must not reach __expf).
__device__ inline float MergeWeight(float m, float merged) { return m > -INFINITY ? __expf(m - merged) : 0.f; }

__device__ inline uint32_t PackBf16(float low, float high) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Attention runs as flash-decoding inside the CTA too: each consumer warp folds its own positions of
// its group's tiles into its own running softmax, so that a tile costs no CTA-wide barrier, and the
// warps merge once at the end of the split. Both products run on tensor cores. Lane (g, t) =
// (lane / 4, lane % 4) in PTX's fragment layouts:
//  - scores: an m16n8k16 product, the KV head's kGroup query heads as rows 0-3 (the rest zero) by
//    the warp's 8 positions, over the head dimension in an order that makes each lane's key words
//    contiguous (a dot product's order is free): k-step s, A or B register j, element i is
//    dimension 16t + 4s + 2j + i. The lane holds head g's scores of positions 2t and 2t + 1, and
//    head g's running max and its part of the running sum (g < kGroup);
//  - output: transposed, O^T = V^T P^T, m16n8k8 products over the warp's 8 positions whose P^T
//    operand is the scores' fragment as it stands (in two BF16 parts). Row r of m-tile m is
//    dimension 8(r % 8) + 2m + r / 8, so that each lane's value fragments are one 16-byte segment
//    of two rows: for t < kGroup / 2 the lane holds dimensions 8g + 2m (out[m][0], [1]) and
//    8g + 2m + 1 ([2], [3]) of heads 2t ([0], [2]) and 2t + 1 ([1], [3]).
struct WarpAttention {
  uint32_t q[4][2];  // A registers 0 and 2 of each k-step (registers 1 and 3, rows g + 8, are zero)
  float max = -INFINITY;
  float sum = 0.f;
  float out[4][4] = {};
};

// The warp's state for the query `q` ([kGroup, kHeadDim], rotated and scaled: FP32 holding BF16
// values, so the rounding is exact).
__device__ inline void StartAttention(WarpAttention& w, const float* q) {
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    const float4 d = g < kGroup ? *reinterpret_cast<const float4*>(q + g * kHeadDim + 16 * t + 4 * step)
                                : make_float4(0.f, 0.f, 0.f, 0.f);
    w.q[step][0] = PackBf16(d.x, d.y);
    w.q[step][1] = PackBf16(d.z, d.w);
  }
}

// Scales the output of the lane's heads by their factors, given as `rescale` in the scores' layout
// (head g's).
__device__ inline void RescaleOutput(WarpAttention& w, float rescale) {
  const int t = threadIdx.x % 32 & 3;
  const float even = __shfl_sync(0xffffffffu, rescale, 8 * t), odd = __shfl_sync(0xffffffffu, rescale, 8 * t + 4);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    w.out[m][0] *= even;
    w.out[m][1] *= odd;
    w.out[m][2] *= even;
    w.out[m][3] *= odd;
  }
}

// Folds a tile's positions [0, valid) of the warp's block (valid > 0) into the warp's softmax:
// `keys` is the lane's 32 bytes of key row g, `values` its 16 bytes at 16g of value rows 2t and
// 2t + 1 (zero past `valid`).
__device__ inline void AttendTile(WarpAttention& w, const uint4 (&keys)[2], const uint4 (&values)[2], int valid) {
  const unsigned all = 0xffffffffu;
  const int t = threadIdx.x % 32 & 3;
  float score[4] = {};
  const uint32_t* k = reinterpret_cast<const uint32_t*>(keys);
#pragma unroll
  for (int step = 0; step < 4; ++step) Mma16816(score, w.q[step][0], 0u, w.q[step][1], 0u, k[2 * step], k[2 * step + 1]);
  const float s0 = 2 * t < valid ? score[0] : -INFINITY;
  const float s1 = 2 * t + 1 < valid ? score[1] : -INFINITY;
  float tile_max = fmaxf(s0, s1);
  tile_max = fmaxf(tile_max, __shfl_xor_sync(all, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(all, tile_max, 2));
  const float now = fmaxf(w.max, tile_max);  // finite: position 0 is valid
  const float rescale = MergeWeight(w.max, now);
  const float p0 = __expf(s0 - now), p1 = __expf(s1 - now);
  w.sum = w.sum * rescale + (p0 + p1);
  w.max = now;
  RescaleOutput(w, rescale);
  // The weights enter the value product as two BF16 parts, so that they keep FP32's precision
  // (one part alone would round each weight by up to 2^-9).
  const __nv_bfloat162 high = __floats2bfloat162_rn(p0, p1);
  const __nv_bfloat162 low = __floats2bfloat162_rn(p0 - __low2float(high), p1 - __high2float(high));
  const uint32_t weights[2] = {*reinterpret_cast<const uint32_t*>(&high), *reinterpret_cast<const uint32_t*>(&low)};
  const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&values[0]);
  const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&values[1]);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t a0 = __byte_perm(v0[m], v1[m], 0x5410), a1 = __byte_perm(v0[m], v1[m], 0x7632);
    Mma1688(w.out[m], a0, a1, weights[0]);
    Mma1688(w.out[m], a0, a1, weights[1]);
  }
}

// Folds one position, this step's own K and V (`kv`: [2, kHeadDim]), into the warp's softmax.
__device__ inline void AttendOwnRow(WarpAttention& w, const float* q, const __nv_bfloat16* kv) {
  const unsigned all = 0xffffffffu;
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3, head = g & (kGroup - 1);
  float score = 0.f;
#pragma unroll
  for (int d = 16 * t; d < 16 * t + 16; ++d) score += q[head * kHeadDim + d] * __bfloat162float(kv[d]);
  score += __shfl_xor_sync(all, score, 1);
  score += __shfl_xor_sync(all, score, 2);
  const float now = fmaxf(w.max, score);
  const float rescale = MergeWeight(w.max, now);
  const float p = __expf(score - now);
  w.sum = w.sum * rescale + (t == 0 ? p : 0.f);
  w.max = now;
  RescaleOutput(w, rescale);
  const float even = __shfl_sync(all, p, 8 * t), odd = __shfl_sync(all, p, 8 * t + 4);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float v0 = __bfloat162float(kv[kHeadDim + 8 * g + 2 * m]), v1 = __bfloat162float(kv[kHeadDim + 8 * g + 2 * m + 1]);
    w.out[m][0] += even * v0;
    w.out[m][1] += odd * v0;
    w.out[m][2] += even * v1;
    w.out[m][3] += odd * v1;
  }
}

// x rotated by the rotary embedding at `position`, element d of a head (as transformers' rotate_half).
__device__ inline float Rotate(const float* head, int d, const float* cos_sin) {
  const int i = d & 31;
  const float partner = Load(head + (d ^ 32));
  const float rotated = d < 32 ? -partner : partner;
  return Bf16(Bf16(Load(head + d) * cos_sin[2 * i]) + Bf16(rotated * cos_sin[2 * i + 1]));
}

__device__ void Attention(const LlamaDecodeArgs& a, const LlamaLayer& layer, const AttentionItem& item, int position,
                          Ring& ring, const AttentionShared& sh, __nv_bfloat16* new_kv, const Workspace& w,
                          unsigned char* ws) {
  const LlamaShape& s = a.shape;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const float* qkv = reinterpret_cast<const float*>(ws + w.qkv);
  if (t < kHeadDim / 2) {
    const float angle = static_cast<float>(position) * a.inv_freq[t];
    sh.cos_sin[2 * t] = Bf16(cosf(angle) * a.rope_attention_scaling);
    sh.cos_sin[2 * t + 1] = Bf16(sinf(angle) * a.rope_attention_scaling);
  }
  ConsumerSync();
  const float scale = rsqrtf(static_cast<float>(kHeadDim));
  if (t < kGroup * kHeadDim) {
    const int h = t >> 6, d = t & 63;
    sh.q[t] = Rotate(qkv + (item.head * kGroup + h) * kHeadDim, d, sh.cos_sin) * scale;
  } else if (t < kGroup * kHeadDim + kHeadDim) {
    const int d = t - kGroup * kHeadDim;
    new_kv[d] = __float2bfloat16(Rotate(qkv + (s.heads + item.head) * kHeadDim, d, sh.cos_sin));
  } else if (t < kGroup * kHeadDim + 2 * kHeadDim) {
    const int d = t - kGroup * kHeadDim - kHeadDim;
    new_kv[kHeadDim + d] = __float2bfloat16(Load(qkv + (s.heads + s.kv_heads + item.head) * kHeadDim + d));
  }
  ConsumerSync();
  TraceMark(kInputClock);
  if (item.last && t < 2 * kHeadDim) {
    __nv_bfloat16* cache = t < kHeadDim ? layer.k_cache : layer.v_cache;
    cache[(Span(item.head, s.capacity) + position) * kHeadDim + t % kHeadDim] = new_kv[t];
  }
  WarpAttention mine;
  StartAttention(mine, sh.q);
  const int group = warp / (kConsumerWarps / kAttentionGroups), block = warp % (kConsumerWarps / kAttentionGroups);
  const int g = lane >> 2, c = lane & 3;  // the lane's (g, t) in WarpAttention's layout
  for (int p = item.begin, tile = 0; p < item.end; p += kAttnTile, ++tile) {
    WaitSlot(ring.full_bar(), ring.parity());
    const int valid = Min(kAttnTile, item.end - p) - block * kWarpPositions;  // the block's positions in the tile
    const bool reads = tile % kAttentionGroups == group && valid > 0;
    uint4 keys[2], values[2];
    if (reads) {
      const unsigned char* rows = ring.tile() + block * kWarpPositions * kHeadDim * 2;
      const uint4* key = reinterpret_cast<const uint4*>(rows + g * kHeadDim * 2 + 32 * c);
      keys[0] = key[0];
      keys[1] = key[1];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        // Past `valid` the slot holds whatever it held before, and a zero weight times a NaN is NaN.
        values[i] = 2 * c + i < valid ? *reinterpret_cast<const uint4*>(rows + kValueOffset + (2 * c + i) * kHeadDim * 2 + 16 * g)
                                      : make_uint4(0, 0, 0, 0);
      }
    }
    ReleaseSlot(ring);
    if (reads) AttendTile(mine, keys, values, valid);
  }
  TraceMark(kTilesClock);
  // This step's own row, by a warp of the group with the fewer tiles.
  if (item.last && warp == kConsumerWarps - 1) AttendOwnRow(mine, sh.q, new_kv);

  // The warps' softmaxes merged into this split's unnormalized output and statistics, then the
  // head's last split to finish merges every split's.
  float warp_sum = mine.sum + __shfl_xor_sync(0xffffffffu, mine.sum, 1);
  warp_sum += __shfl_xor_sync(0xffffffffu, warp_sum, 2);
  if (g < kGroup && c == 0) {
    sh.max[warp * kGroup + g] = mine.max;
    sh.sum[warp * kGroup + g] = warp_sum;
  }
  if (c < kGroup / 2) {
    float* even = sh.out + (warp * kGroup + 2 * c) * kHeadDim + 8 * g;
    float* odd = even + kHeadDim;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      even[2 * i] = mine.out[i][0];
      odd[2 * i] = mine.out[i][1];
      even[2 * i + 1] = mine.out[i][2];
      odd[2 * i + 1] = mine.out[i][3];
    }
  }
  ConsumerSync();
  float* attn = reinterpret_cast<float*>(ws + w.attn) + item.head * kGroup * kHeadDim;
  float* part_o = reinterpret_cast<float*>(ws + w.part_o);
  float* part_m = reinterpret_cast<float*>(ws + w.part_m);
  float* part_l = reinterpret_cast<float*>(ws + w.part_l);
  const int slot = item.head * kMaxSplits + item.split;
  if (t < kGroup * kHeadDim) {
    const int h = t >> 6;
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kConsumerWarps; ++i) m = fmaxf(m, sh.max[i * kGroup + h]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int i = 0; i < kConsumerWarps; ++i) {
      const float weight = MergeWeight(sh.max[i * kGroup + h], m);
      sum += weight * sh.sum[i * kGroup + h];
      o += weight * sh.out[(i * kGroup) * kHeadDim + t];
    }
    if (item.splits == 1) {
      attn[t] = Bf16(o / sum);
    } else {
      part_o[slot * kGroup * kHeadDim + t] = o;
      if ((t & 63) == 0) {
        part_m[slot * kGroup + h] = m;
        part_l[slot * kGroup + h] = sum;
      }
    }
  }
  if (item.splits == 1) return;
  ConsumerSync();
  __shared__ int last_to_finish;
  if (t == 0) {
    // Releases this CTA's part (the CTA's barrier above orders its threads' writes before it) and
    // acquires the others'.
    uint32_t* count = reinterpret_cast<uint32_t*>(ws + w.head_count) + item.head;
    last_to_finish = AddAcquireRelease(count, 1) == static_cast<uint32_t>(item.splits - 1);
    if (last_to_finish) atomicExch(count, 0);
  }
  ConsumerSync();
  if (!last_to_finish || t >= kGroup * kHeadDim) return;
  // Every split's part, merged kMergeBatch at a time: one round trip to L2 per batch.
  constexpr int kMergeBatch = 8;
  const int h = t >> 6, first = item.head * kMaxSplits;
  float m = -INFINITY, sum = 0.f, o = 0.f;
  for (int batch = 0; batch < item.splits; batch += kMergeBatch) {
    float batch_m[kMergeBatch], batch_l[kMergeBatch], batch_o[kMergeBatch];
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const int i = first + batch + j;
      const bool here = batch + j < item.splits;
      batch_m[j] = here ? Load(part_m + i * kGroup + h) : -INFINITY;
      batch_l[j] = here ? Load(part_l + i * kGroup + h) : 0.f;
      batch_o[j] = here ? Load(part_o + i * kGroup * kHeadDim + t) : 0.f;
    }
    float now = m;
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) now = fmaxf(now, batch_m[j]);
    const float rescale = MergeWeight(m, now);
    sum *= rescale;
    o *= rescale;
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const float weight = MergeWeight(batch_m[j], now);
      sum += weight * batch_l[j];
      o += weight * batch_o[j];
    }
    m = now;
  }
  attn[t] = Bf16(o / sum);
}

__device__ void Consume(const LlamaDecodeArgs& a, Ring ring, int position, int64_t token, unsigned char* smem,
                        const Shared& m) {
  const LlamaShape& s = a.shape;
  const Workspace w = WorkspaceLayout(s);
  auto* ws = static_cast<unsigned char*>(a.workspace);
  float* x = reinterpret_cast<float*>(ws + w.x);
  float* qkv = reinterpret_cast<float*>(ws + w.qkv);
  float* h = reinterpret_cast<float*>(ws + w.h);
  GridBarrier barrier(reinterpret_cast<uint64_t*>(ws + w.arrivals), kStagesPerLayer * s.layers);
  auto* input = reinterpret_cast<__nv_bfloat16*>(smem + m.input);
  float* dots = reinterpret_cast<float*>(smem + m.dots);
  float* residual = reinterpret_cast<float*>(smem + m.residual);
  float* reduce = reinterpret_cast<float*>(smem + m.reduce);
  float* stats = reinterpret_cast<float*>(smem + m.stats);
  const AttentionShared sh{reinterpret_cast<float*>(smem + m.q), reinterpret_cast<float*>(smem + m.cos_sin), stats,
                           stats + kConsumerWarps * kGroup, reinterpret_cast<float*>(smem + m.input)};
  auto* new_kv = reinterpret_cast<__nv_bfloat16*>(smem + m.new_kv);
  const __nv_bfloat16* embedding_row = a.embedding + token * s.hidden;
  const AttentionItem item = AttentionItemOf(s, position);
  const int attn_width = s.heads * s.head_dim;
  const int t = threadIdx.x;

  for (int l = 0; l < s.layers; ++l) {
    const LlamaLayer& layer = a.layer[l];
    // qkv = norm(x) . Wqkv
    Rows r = RowsOf(QkvRows(s), l, 0);
    Dots d{dots, r.end - r.begin};
    LoadNormed(input, l == 0 ? nullptr : x, embedding_row, layer.input_norm, s.hidden, s.rms_eps, reduce);
    TraceMark(kInputClock);
    ConsumeSlice(ring, d, input, s.hidden);
    TraceMark(kTilesClock);
    ConsumerSync();
    for (int i = t; i < d.rows; i += kConsumerThreads) qkv[r.begin + i] = Bf16(d.Row(i));
    barrier.Sync();

    if (item.head >= 0) Attention(a, layer, item, position, ring, sh, new_kv, w, ws);
    barrier.Sync();

    // x += attn . Wo
    r = RowsOf(s.hidden, l, 2);
    d = {dots, r.end - r.begin};
    LoadResidual(residual, l == 0 ? nullptr : x, embedding_row, r);
    LoadVector(input, reinterpret_cast<const float*>(ws + w.attn), attn_width);
    TraceMark(kInputClock);
    ConsumeSlice(ring, d, input, attn_width);
    TraceMark(kTilesClock);
    ConsumerSync();
    for (int i = t; i < d.rows; i += kConsumerThreads) x[r.begin + i] = Bf16(residual[i] + Bf16(d.Row(i)));
    barrier.Sync();

    // h = silu(norm(x) . Wgate) * (norm(x) . Wup)
    r = RowsOf(s.ffn, l, 3);
    const Dots gate{dots, r.end - r.begin};
    const Dots up{dots + gate.rows * kConsumerWarps, gate.rows};
    LoadNormed(input, x, nullptr, layer.post_norm, s.hidden, s.rms_eps, reduce);
    TraceMark(kInputClock);
    ConsumeSlice(ring, gate, input, s.hidden);
    ConsumeSlice(ring, up, input, s.hidden);
    TraceMark(kTilesClock);
    ConsumerSync();
    for (int i = t; i < gate.rows; i += kConsumerThreads) {
      const float g = Bf16(gate.Row(i));
      h[r.begin + i] = Bf16(Bf16(g / (1.f + __expf(-g))) * Bf16(up.Row(i)));
    }
    barrier.Sync();

    // x += h . Wdown
    r = RowsOf(s.hidden, l, 4);
    d = {dots, r.end - r.begin};
    LoadResidual(residual, x, nullptr, r);
    LoadVector(input, h, s.ffn);
    TraceMark(kInputClock);
    ConsumeSlice(ring, d, input, s.ffn);
    TraceMark(kTilesClock);
    ConsumerSync();
    for (int i = t; i < d.rows; i += kConsumerThreads) x[r.begin + i] = Bf16(residual[i] + Bf16(d.Row(i)));
    barrier.Sync();
  }
  // logits = norm(x) . Wlm
  const Rows r = RowsOf(s.vocab, s.layers, 0);
  const Dots d{dots, r.end - r.begin};
  LoadNormed(input, x, nullptr, a.final_norm, s.hidden, s.rms_eps, reduce);
  ConsumeSlice(ring, d, input, s.hidden);
  ConsumerSync();
  for (int i = t; i < d.rows; i += kConsumerThreads) a.logits[r.begin + i] = __float2bfloat16(d.Row(i));
}

__global__ void __launch_bounds__(kThreads, 1) LlamaDecodeStepKernel(const __grid_constant__ LlamaDecodeArgs a) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const LlamaShape& s = a.shape;
  const Shared m = SharedLayout(s, gridDim.x);
  const int64_t position = *a.position;
  const int64_t token = *a.token;
  if (position < 0 || position >= s.capacity || token < 0 || token >= s.vocab) {
    // NaN logits: a caller that reads them before the error word still cannot take them for a step.
    const __nv_bfloat16 nan = __ushort_as_bfloat16(0x7fc0);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < s.vocab; i += gridDim.x * blockDim.x) a.logits[i] = nan;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      *a.error = position < 0 || position >= s.capacity ? kBadPosition : kBadToken;
    }
    return;
  }
  Ring ring{smem, reinterpret_cast<uint64_t*>(smem + m.full), reinterpret_cast<uint64_t*>(smem + m.empty), 0};
  if (threadIdx.x == 0) {
    for (int i = 0; i < kRing; ++i) {
      BarrierInit(&ring.full[i], 1);
      BarrierInit(&ring.empty[i], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x / 32 == kProducerWarp) {
    Produce(a, ring, static_cast<int>(position));
    return;
  }
  Consume(a, ring, static_cast<int>(position), token, smem, m);
}

// Why a pointer of `a` cannot serve the step, or empty: each must be set, and aligned as the step
// reads it: 16 bytes for what it copies 16 bytes at a time (the bulk copies' sources), else its
// element's size. Checked at every launch, so it builds a message only for a pointer at fault.
std::string UnusablePointer(const LlamaDecodeArgs& a) {
  struct Pointer {
    const char* name;
    const void* at;
    uintptr_t alignment;
  };
  constexpr uintptr_t kBulk = 16;
  auto fault = [](const Pointer& p) -> std::string {
    if (p.at == nullptr) return std::string(p.name) + " is null";
    if (reinterpret_cast<uintptr_t>(p.at) % p.alignment == 0) return "";
    return std::string(p.name) + " is not " + std::to_string(p.alignment) + "-byte aligned" +
           (p.alignment == kBulk ? " (the step copies it 16 bytes at a time)" : "");
  };
  for (int l = 0; l < a.shape.layers; ++l) {
    const LlamaLayer& layer = a.layer[l];
    const Pointer pointers[] = {{"input_norm", layer.input_norm, 2}, {"qkv", layer.qkv, kBulk},
                                {"o", layer.o, kBulk},                {"post_norm", layer.post_norm, 2},
                                {"gate", layer.gate, kBulk},          {"up", layer.up, kBulk},
                                {"down", layer.down, kBulk},          {"k_cache", layer.k_cache, kBulk},
                                {"v_cache", layer.v_cache, kBulk}};
    for (const Pointer& p : pointers) {
      if (std::string why = fault(p); !why.empty()) return "layer " + std::to_string(l) + "'s " + why;
    }
  }
  const Pointer pointers[] = {{"embedding", a.embedding, 2}, {"final_norm", a.final_norm, 2},
                              {"lm_head", a.lm_head, kBulk},  {"inv_freq", a.inv_freq, 4},
                              {"token", a.token, 8},          {"position", a.position, 8},
                              {"logits", a.logits, 2},        {"workspace", a.workspace, 8},
                              {"error", a.error, 4}};
  for (const Pointer& p : pointers) {
    if (std::string why = fault(p); !why.empty()) return why;
  }
  return "";
}

int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  return sms;
}

}  // namespace

#ifdef ZEROKV_MEGAKERNEL_TRACE
// The trace's shape, [ctas, barriers, fields] (TraceField's order), and the barriers a layer, for its
// reader.
extern "C" void zerokv_megakernel_trace_layout(int* ctas, int* barriers, int* fields, int* per_layer) {
  *ctas = kTraceCtas;
  *barriers = kTraceBarriers;
  *fields = kTraceFields;
  *per_layer = kStagesPerLayer;
}

// Copies the trace of the launches since the last call into `out` and each CTA's records into `counts`,
// then resets it.
extern "C" int zerokv_megakernel_trace(uint64_t* out, int* counts) {
  if (cudaMemcpyFromSymbol(out, g_trace, sizeof(g_trace)) != cudaSuccess) return -1;
  if (cudaMemcpyFromSymbol(counts, g_trace_at, sizeof(g_trace_at)) != cudaSuccess) return -1;
  static int zeros[kTraceCtas] = {};
  static uint64_t no_waits[kTraceCtas][2] = {};
  if (cudaMemcpyToSymbol(g_waited, no_waits, sizeof(no_waits)) != cudaSuccess) return -1;
  return cudaMemcpyToSymbol(g_trace_at, zeros, sizeof(zeros)) == cudaSuccess ? 0 : -1;
}
#endif

std::string UnsupportedShape(const LlamaShape& s) {
  if (s.layers < 1 || s.layers > kMaxLayers) {
    return "layers is " + std::to_string(s.layers) + ", not in [1, " + std::to_string(kMaxLayers) + "]";
  }
  if (s.head_dim != kHeadDim) return "head_dim is " + std::to_string(s.head_dim) + ", not " + std::to_string(kHeadDim);
  if (s.kv_heads < 1 || s.heads != kGroup * s.kv_heads) {
    return "heads (" + std::to_string(s.heads) + ") is not " + std::to_string(kGroup) + " x kv_heads (" +
           std::to_string(s.kv_heads) + ")";
  }
  for (const auto& [name, k] : {std::pair{"hidden", s.hidden}, std::pair{"ffn", s.ffn},
                                std::pair{"heads x head_dim", s.heads * s.head_dim}}) {
    if (k <= 0 || k % kSegment != 0) {
      return std::string(name) + " is " + std::to_string(k) + ", not a multiple of " + std::to_string(kSegment) +
             " (a tile's columns)";
    }
    if (k > kMaxWidth) return std::string(name) + " is " + std::to_string(k) + ", wider than " + std::to_string(kMaxWidth) + " (the widest product the step is tested with)";
  }
  if (s.vocab < 1) return "vocab is " + std::to_string(s.vocab);
  if (s.capacity < 1) return "capacity is " + std::to_string(s.capacity);
  return "";
}

size_t LlamaDecodeWorkspaceBytes(const LlamaShape& shape) { return WorkspaceLayout(shape).bytes; }

cudaError_t LaunchLlamaDecodeStep(const LlamaDecodeArgs& args, cudaStream_t stream, std::string* error) {
  if (std::string why = UnsupportedShape(args.shape); !why.empty()) {
    *error = "unsupported shape: " + why;
    return cudaErrorInvalidValue;
  }
  if (std::string why = UnusablePointer(args); !why.empty()) {
    *error = "unusable argument: " + why;
    return cudaErrorInvalidValue;
  }
  const int sms = SmCount();
  if (sms < args.shape.kv_heads) {
    *error = "the GPU has " + std::to_string(sms) + " SMs, fewer than the KV heads";
    return cudaErrorInvalidConfiguration;
  }
  const size_t smem = SharedLayout(args.shape, sms).bytes;
  cudaError_t status =
      cudaFuncSetAttribute(LlamaDecodeStepKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status != cudaSuccess) {
    *error = "the step needs " + std::to_string(smem) + " bytes of shared memory per CTA: " + cudaGetErrorString(status);
    return status;
  }
  int per_sm = 0;
  status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, LlamaDecodeStepKernel, kThreads, smem);
  if (status != cudaSuccess || per_sm < 1) {
    *error = "one CTA of the step does not fit an SM";
    return status != cudaSuccess ? status : cudaErrorInvalidConfiguration;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(sms);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  status = cudaLaunchKernelEx(&config, LlamaDecodeStepKernel, args);
  if (status != cudaSuccess) *error = std::string("launching the step: ") + cudaGetErrorString(status);
  return status;
}

}  // namespace zerokv::engines::megakernel
