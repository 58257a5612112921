// The persistent decode-step kernel of llama_decode_step.h.
//
// Each CTA (one per SM) runs a producer warp and kConsumerWarps consumer warps. Both walk the same
// schedule: per layer, the CTA's rows of qkv, its attention work item's K and V tiles, its rows of o,
// gate, up and down, then its rows of the LM head. The producer copies each tile into the next slot
// of a ring in shared memory and never waits for activations; the consumers wait for each stage's
// inputs at a grid barrier, then take the tiles in the same order. Numerics follow transformers'
// BF16 Llama: every tensor the model keeps in BF16 (residual stream, projections, rotary products,
// attention output) is rounded to BF16 where the model rounds it; sums accumulate in FP32.
#include "cc/engines/megakernel/llama_decode_step.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace zerokv::engines::megakernel {
namespace {

constexpr int kTileBytes = 16384;
constexpr int kTileElems = kTileBytes / 2;
constexpr int kConsumerWarps = 16;
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kProducerWarp = kConsumerWarps;
// A consumer warp's share of a full tile: one row segment, so each warp's dot product has one row.
constexpr int kSegment = kTileElems / kConsumerWarps;
#ifndef ZEROKV_MEGAKERNEL_RING
#define ZEROKV_MEGAKERNEL_RING 10
#endif
// 160 KiB in flight per SM: the ~35 KiB that keeps an SM's share of HBM busy, several times over,
// so that a grid barrier's wait is spent streaming.
constexpr int kRing = ZEROKV_MEGAKERNEL_RING;
constexpr int kHeadDim = 64;
constexpr int kGroup = 4;       // query heads per KV head: the attention stage's thread mapping
constexpr int kAttnTile = 64;   // positions per attention tile: K rows, then V rows at kValueOffset
constexpr int kValueOffset = kAttnTile * kHeadDim * 2;
constexpr int kMaxSplits = 32;  // attention work items per KV head, at most
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
  size_t x, qkv, attn, h, part_o, part_m, part_l, head_count, barrier_count, barrier_gen, bytes;
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
  w.barrier_count = take(sizeof(uint32_t));
  w.barrier_gen = take(sizeof(uint32_t));
  w.bytes = at;
  return w;
}

// Rows per CTA, at most, over every stage: the size of the accumulator in shared memory.
__host__ __device__ inline int MaxRowsPerCta(const LlamaShape& s, int ctas) {
  int rows = CeilDiv(QkvRows(s), ctas);
  rows = Max(rows, CeilDiv(s.hidden, ctas));
  rows = Max(rows, 2 * CeilDiv(s.ffn, ctas));
  return Max(rows, CeilDiv(s.vocab, ctas));
}

__host__ __device__ inline int MaxInput(const LlamaShape& s) {
  return Max(Max(s.hidden, s.ffn), s.heads * s.head_dim);
}

struct Shared {
  size_t full, empty, input, acc, q, score, stats, new_kv, reduce, bytes;
};

__host__ __device__ inline Shared SharedLayout(const LlamaShape& s, int ctas) {
  Shared m{};
  size_t at = size_t{kRing} * kTileBytes;
  auto take = [&](size_t bytes) { const size_t here = at; at += (bytes + 127) & ~size_t{127}; return here; };
  m.full = take(sizeof(uint64_t) * kRing);
  m.empty = take(sizeof(uint64_t) * kRing);
  m.input = take(sizeof(float) * MaxInput(s));
  m.acc = take(sizeof(float) * MaxRowsPerCta(s, ctas));
  m.q = take(sizeof(float) * kGroup * kHeadDim);
  m.score = take(sizeof(float) * kGroup * kAttnTile);
  m.stats = take(sizeof(float) * 3 * kGroup);  // running max, running sum, rescale per head
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
  const int splits = Max(1, Min(max_splits, CeilDiv(position, kAttnTile)));
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

#ifndef ZEROKV_MEGAKERNEL_PREFETCH
#define ZEROKV_MEGAKERNEL_PREFETCH 0
#endif
#if ZEROKV_MEGAKERNEL_PREFETCH == 0
// The producer as run on the H200 (decode_roofline_notes.md).
__device__ inline void ProduceSlice(Ring& ring, const __nv_bfloat16* base, size_t elems, uint64_t policy) {
  for (size_t at = 0; at < elems; at += kTileElems) {
    const uint32_t n = static_cast<uint32_t>(Min<size_t>(kTileElems, elems - at));
    WaitParity(ring.empty_bar(), ring.parity() ^ 1);
    ArriveExpectBytes(ring.full_bar(), n * 2);
    BulkCopy(ring.tile(), base + at, n * 2, ring.full_bar(), policy);
    ++ring.count;
  }
}

__device__ inline void ProduceAttention(Ring& ring, const LlamaShape& s, const LlamaLayer& layer,
                                        const AttentionItem& item) {
  if (item.head < 0) return;
  const size_t head_rows = Span(item.head, s.capacity);
  for (int p = item.begin; p < item.end; p += kAttnTile) {
    const uint32_t n = Min(kAttnTile, item.end - p);
    const uint32_t bytes = n * kHeadDim * 2;
    WaitParity(ring.empty_bar(), ring.parity() ^ 1);
    ArriveExpectBytes(ring.full_bar(), 2 * bytes);
    BulkCopy(ring.tile(), layer.k_cache + (head_rows + p) * kHeadDim, bytes, ring.full_bar());
    BulkCopy(ring.tile() + kValueOffset, layer.v_cache + (head_rows + p) * kHeadDim, bytes, ring.full_bar());
    ++ring.count;
  }
}

__device__ void Produce(const LlamaDecodeArgs& a, Ring ring, int position) {
  const LlamaShape& s = a.shape;
  const uint64_t policy = EvictFirstPolicy();
  const AttentionItem item = AttentionItemOf(s, position);
  const int attn_width = s.heads * s.head_dim;
  for (int l = 0; l < s.layers; ++l) {
    const LlamaLayer& layer = a.layer[l];
    Rows r = RowsOf(QkvRows(s), l, 0);
    ProduceSlice(ring, layer.qkv + Span(r.begin, s.hidden),
                 Span(r.end - r.begin, s.hidden), policy);
    ProduceAttention(ring, s, layer, item);
    r = RowsOf(s.hidden, l, 2);
    ProduceSlice(ring, layer.o + Span(r.begin, attn_width),
                 Span(r.end - r.begin, attn_width), policy);
    r = RowsOf(s.ffn, l, 3);
    ProduceSlice(ring, layer.gate + Span(r.begin, s.hidden),
                 Span(r.end - r.begin, s.hidden), policy);
    ProduceSlice(ring, layer.up + Span(r.begin, s.hidden),
                 Span(r.end - r.begin, s.hidden), policy);
    r = RowsOf(s.hidden, l, 4);
    ProduceSlice(ring, layer.down + Span(r.begin, s.ffn),
                 Span(r.end - r.begin, s.ffn), policy);
  }
  const Rows r = RowsOf(s.vocab, s.layers, 0);
  ProduceSlice(ring, a.lm_head + Span(r.begin, s.hidden),
               Span(r.end - r.begin, s.hidden), policy);
}

#else
// An experiment, not yet run (megakernel_profile.py's prefetch variants): the producer also asks L2
// for the tiles ZEROKV_MEGAKERNEL_PREFETCH ahead of its ring.
// One tile of the CTA's stream: `bytes` from `src` (and as many from `second` at kValueOffset).
struct Tile {
  const void* src;
  const void* second;
  uint32_t bytes;
};

// The CTA's tiles in the order the consumers take them: per layer its rows of qkv, its attention
// item's K and V, its rows of o, gate, up and down; then its rows of the LM head.
class TileWalk {
 public:
  __device__ TileWalk(const LlamaDecodeArgs& a, const AttentionItem& item) : a_(a), item_(item) { Enter(); }

  __device__ bool Next(Tile* tile) {
    while (layer_ <= a_.shape.layers && at_ >= elems_) {
      ++part_;
      if (part_ == kParts || layer_ == a_.shape.layers) {
        part_ = 0;
        ++layer_;
      }
      Enter();
    }
    if (layer_ > a_.shape.layers) return false;
    if (part_ == kAttentionPart) {
      const size_t row = Span(item_.head, a_.shape.capacity) + item_.begin + at_;
      const uint32_t n = static_cast<uint32_t>(Min<size_t>(kAttnTile, elems_ - at_));
      const LlamaLayer& layer = a_.layer[layer_];
      *tile = {layer.k_cache + row * kHeadDim, layer.v_cache + row * kHeadDim, n * kHeadDim * 2};
      at_ += n;
    } else {
      const uint32_t n = static_cast<uint32_t>(Min<size_t>(kTileElems, elems_ - at_));
      *tile = {base_ + at_, nullptr, n * 2};
      at_ += n;
    }
    return true;
  }

 private:
  static constexpr int kParts = 6;  // qkv, attention, o, gate, up, down
  static constexpr int kAttentionPart = 1;

  // base_ and elems_ of (layer_, part_): elements of a weight slice, or positions of attention.
  __device__ void Enter() {
    const LlamaShape& s = a_.shape;
    at_ = 0;
    elems_ = 0;
    if (layer_ > s.layers) return;
    if (layer_ == s.layers) {
      const Rows r = RowsOf(s.vocab, s.layers, 0);
      base_ = a_.lm_head + Span(r.begin, s.hidden);
      elems_ = Span(r.end - r.begin, s.hidden);
      return;
    }
    const LlamaLayer& layer = a_.layer[layer_];
    const int attn_width = s.heads * s.head_dim;
    Rows r{0, 0};
    switch (part_) {
      case 0:
        r = RowsOf(QkvRows(s), layer_, 0);
        base_ = layer.qkv + Span(r.begin, s.hidden);
        elems_ = Span(r.end - r.begin, s.hidden);
        break;
      case kAttentionPart:
        elems_ = item_.head < 0 ? 0 : item_.end - item_.begin;
        break;
      case 2:
        r = RowsOf(s.hidden, layer_, 2);
        base_ = layer.o + Span(r.begin, attn_width);
        elems_ = Span(r.end - r.begin, attn_width);
        break;
      case 3:
      case 4:
        r = RowsOf(s.ffn, layer_, 3);
        base_ = (part_ == 3 ? layer.gate : layer.up) + Span(r.begin, s.hidden);
        elems_ = Span(r.end - r.begin, s.hidden);
        break;
      default:
        r = RowsOf(s.hidden, layer_, 4);
        base_ = layer.down + Span(r.begin, s.ffn);
        elems_ = Span(r.end - r.begin, s.ffn);
    }
  }

  const LlamaDecodeArgs& a_;
  const AttentionItem item_;
  int layer_ = 0, part_ = 0;
  const __nv_bfloat16* base_ = nullptr;
  size_t at_ = 0, elems_ = 0;
};

__device__ inline void PrefetchL2(const Tile& tile) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(tile.src), "r"(tile.bytes) : "memory");
  if (tile.second) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(tile.second), "r"(tile.bytes) : "memory");
  }
}

// Tiles the producer asks L2 for ahead of the ring: while the consumers wait at a grid barrier and
// the ring is full, HBM keeps streaming this CTA's next tiles into L2 (at 24, 16 KiB each, about
// 3 MiB over the GPU of the H200's 50 MiB L2: several barriers' worth of streaming).
constexpr int kPrefetchTiles = ZEROKV_MEGAKERNEL_PREFETCH;

__device__ void Produce(const LlamaDecodeArgs& a, Ring ring, int position) {
  const uint64_t policy = EvictFirstPolicy();
  const AttentionItem item = AttentionItemOf(a.shape, position);
  TileWalk copies(a, item), ahead(a, item);
  Tile tile, later;
  for (int i = 0; i < kPrefetchTiles && ahead.Next(&later); ++i) PrefetchL2(later);
  while (copies.Next(&tile)) {
    if (ahead.Next(&later)) PrefetchL2(later);
    WaitParity(ring.empty_bar(), ring.parity() ^ 1);
    ArriveExpectBytes(ring.full_bar(), tile.second ? 2 * tile.bytes : tile.bytes);
    if (tile.second) {
      // No evict-first hint on the KV rows: the next step reads them again.
      BulkCopy(ring.tile(), tile.src, tile.bytes, ring.full_bar());
      BulkCopy(ring.tile() + kValueOffset, tile.second, tile.bytes, ring.full_bar());
    } else {
      BulkCopy(ring.tile(), tile.src, tile.bytes, ring.full_bar(), policy);
    }
    ++ring.count;
  }
}

#endif  // ZEROKV_MEGAKERNEL_PREFETCH

// --- consumers ---

__device__ inline void ConsumerSync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory"); }

__device__ inline float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ inline float Bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ inline float Load(const float* p) { return __ldcg(p); }  // written by other CTAs this step

__device__ inline uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ inline void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

#ifdef ZEROKV_MEGAKERNEL_TRACE
// Diagnostics (megakernel_profile.py builds with it): each CTA's global time at every barrier's
// arrival and departure.
constexpr int kTraceBarriers = kMaxLayers * kStagesPerLayer;
__device__ uint64_t g_trace[256][kTraceBarriers][2];
__device__ int g_trace_at[256];
__device__ inline uint64_t GlobalTime() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#endif

// Every CTA's consumers reach it before any passes: a sense-reversing barrier whose count is back
// at zero when it opens, so that every step (and every graph replay) starts from the same state.
__device__ void GridSync(uint32_t* count, uint32_t* gen) {
  ConsumerSync();
#ifdef ZEROKV_MEGAKERNEL_TRACE
  const int at = g_trace_at[blockIdx.x];
  if (threadIdx.x == 0 && at < kTraceBarriers) g_trace[blockIdx.x][at][0] = GlobalTime();
#endif
#ifdef ZEROKV_MEGAKERNEL_NO_GRID_SYNC
  if (false) {
#else
  if (threadIdx.x == 0) {
#endif
    const uint32_t g = LoadAcquire(gen);
    __threadfence();
    if (atomicAdd(count, 1) == gridDim.x - 1) {
      atomicExch(count, 0);
      __threadfence();
      StoreRelease(gen, g + 1);
    } else {
      while (LoadAcquire(gen) == g) {
      }
    }
    __threadfence();
  }
  ConsumerSync();
#ifdef ZEROKV_MEGAKERNEL_TRACE
  if (threadIdx.x == 0 && at < kTraceBarriers) {
    g_trace[blockIdx.x][at][1] = GlobalTime();
    g_trace_at[blockIdx.x] = at + 1;
  }
#endif
}

__device__ inline float Dot8(uint4 w, float4 x0, float4 x1) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
  const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.z));
  const float2 d = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.w));
  return a.x * x0.x + a.y * x0.y + b.x * x0.z + b.y * x0.w + c.x * x1.x + c.y * x1.y + d.x * x1.z + d.y * x1.w;
}

// acc[row] += slice[row, :] . input, over a `k`-column slice of `elems` elements arriving as tiles.
__device__ void ConsumeSlice(Ring& ring, size_t elems, int k, const float* input, float* acc) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (size_t at = 0; at < elems; at += kTileElems) {
    const size_t n = Min<size_t>(kTileElems, elems - at);
    WaitParity(ring.full_bar(), ring.parity());
    const size_t segment = Span(warp, kSegment);
    if (segment < n) {
      const size_t e = at + segment;
      const int row = static_cast<int>(e / k), col = static_cast<int>(e % k);
      const uint4* w = reinterpret_cast<const uint4*>(ring.tile()) + warp * (kSegment / 8);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kSegment / 8 / 32; ++j) {
        const int v = j * 32 + lane;
        const float4* x = reinterpret_cast<const float4*>(input + col + v * 8);
        sum += Dot8(w[v], x[0], x[1]);
      }
      sum = WarpSum(sum);
      if (lane == 0) atomicAdd(&acc[row], sum);
    }
    __syncwarp();
    if (lane == 0) Arrive(ring.empty_bar());
    ++ring.count;
  }
}

__device__ inline void ZeroRows(float* acc, int rows) {
  for (int i = threadIdx.x; i < rows; i += kConsumerThreads) acc[i] = 0.f;
}

// input = RMSNorm(x) * weight, rounded as transformers' LlamaRMSNorm rounds it. `x` is the residual
// stream, or null for the embedding row (the first layer's input).
__device__ void LoadNormed(float* input, const float* x, const __nv_bfloat16* embedding_row,
                           const __nv_bfloat16* weight, int n, float eps, float* reduce) {
  float squares = 0.f;
  for (int i = threadIdx.x; i < n; i += kConsumerThreads) {
    const float v = x ? Load(x + i) : __bfloat162float(embedding_row[i]);
    input[i] = v;
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
    input[i] = Bf16(Bf16(input[i] * scale) * __bfloat162float(weight[i]));
  }
  ConsumerSync();
}

__device__ inline void LoadVector(float* input, const float* v, int n) {
  for (int i = threadIdx.x; i < n; i += kConsumerThreads) input[i] = Load(v + i);
  ConsumerSync();
}

struct AttentionShared {
  float* q;       // [kGroup, kHeadDim], rotated and scaled
  float* score;   // [kGroup, kAttnTile]
  float* max;     // [kGroup]
  float* sum;     // [kGroup]
  float* rescale; // [kGroup]
  float* scratch; // the stage's input buffer, free during attention
};

#ifdef ZEROKV_MEGAKERNEL_QUARTER_PV
// An experiment, not yet run (megakernel_profile.py's quarter_pv variant): each thread accumulates
// two dimensions of one head over a quarter of each tile's positions, BF16 pairs at a time.
using AttentionAcc = float2;
#else
// A thread accumulates one dimension of one head over half of each tile's positions.
using AttentionAcc = float;
#endif

// Folds `n` positions (keys and values [n, kHeadDim]) into the running softmax of the CTA's
// kGroup query heads; `out` is the thread's running share of the output (see Attention).
__device__ void AttendTile(const AttentionShared& a, const __nv_bfloat16* keys, const __nv_bfloat16* values, int n,
                           AttentionAcc& out) {
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  {
    const int h = t >> 7, p = (t & 127) >> 1, half = t & 1;
    float s = 0.f;
    if (p < n) {
      const uint4* k = reinterpret_cast<const uint4*>(keys + p * kHeadDim + half * 32);
      const float* q = a.q + h * kHeadDim + half * 32;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int chunk = (i + p) & 3;  // lanes of a quarter-warp read distinct banks
        const float4* qc = reinterpret_cast<const float4*>(q + chunk * 8);
        s += Dot8(k[chunk], qc[0], qc[1]);
      }
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (half == 0) a.score[h * kAttnTile + p] = p < n ? s : -INFINITY;
  }
  ConsumerSync();
  if (warp < kGroup) {
    float* score = a.score + warp * kAttnTile;
    const float s0 = score[lane], s1 = score[lane + 32];
    const float previous = a.max[warp];
    const float now = fmaxf(previous, WarpMax(fmaxf(s0, s1)));
    const float e0 = __expf(s0 - now), e1 = __expf(s1 - now);
    score[lane] = e0;
    score[lane + 32] = e1;
    const float sum = WarpSum(e0 + e1);
    if (lane == 0) {
      const float rescale = __expf(previous - now);
      a.rescale[warp] = rescale;
      a.sum[warp] = a.sum[warp] * rescale + sum;
      a.max[warp] = now;
    }
  }
  ConsumerSync();
#ifdef ZEROKV_MEGAKERNEL_QUARTER_PV
  {
    const int h = t >> 7, pair = t & 31, quarter = (t >> 5) & 3;
    const float* p = a.score + h * kAttnTile;
    const float rescale = a.rescale[h];
    float2 acc = {out.x * rescale, out.y * rescale};
    const int end = Min(n, quarter * 16 + 16);
#pragma unroll 4
    for (int i = quarter * 16; i < end; ++i) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(values + i * kHeadDim + 2 * pair));
      acc.x += p[i] * v.x;
      acc.y += p[i] * v.y;
    }
    out = acc;
  }
#else
  {
    const int o = t & 255, h = o >> 6, d = o & 63, half = t >> 8;
    const float* p = a.score + h * kAttnTile;
    float acc = out * a.rescale[h];
    const int end = Min(n, half * 32 + 32);
    for (int i = half * 32; i < end; ++i) acc += p[i] * __bfloat162float(values[i * kHeadDim + d]);
    out = acc;
  }
#endif
  ConsumerSync();
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
  const int t = threadIdx.x;
  const float* qkv = reinterpret_cast<const float*>(ws + w.qkv);
  // cos and sin of the position's angles, in the model's dtype, over score[] until the first tile.
  float* cos_sin = sh.score;
  if (t < 32) {
    const float angle = static_cast<float>(position) * a.inv_freq[t];
    cos_sin[2 * t] = Bf16(cosf(angle) * a.rope_attention_scaling);
    cos_sin[2 * t + 1] = Bf16(sinf(angle) * a.rope_attention_scaling);
  }
  if (t < kGroup) {
    sh.max[t] = -INFINITY;
    sh.sum[t] = 0.f;
  }
  ConsumerSync();
  const float scale = rsqrtf(static_cast<float>(kHeadDim));
  if (t < kGroup * kHeadDim) {
    const int h = t >> 6, d = t & 63;
    sh.q[t] = Rotate(qkv + (item.head * kGroup + h) * kHeadDim, d, cos_sin) * scale;
  } else if (t < kGroup * kHeadDim + kHeadDim) {
    const int d = t - kGroup * kHeadDim;
    new_kv[d] = __float2bfloat16(Rotate(qkv + (s.heads + item.head) * kHeadDim, d, cos_sin));
  } else if (t < kGroup * kHeadDim + 2 * kHeadDim) {
    const int d = t - kGroup * kHeadDim - kHeadDim;
    new_kv[kHeadDim + d] = __float2bfloat16(Load(qkv + (s.heads + s.kv_heads + item.head) * kHeadDim + d));
  }
  ConsumerSync();
  if (item.last && t < 2 * kHeadDim) {
    __nv_bfloat16* cache = t < kHeadDim ? layer.k_cache : layer.v_cache;
    cache[(Span(item.head, s.capacity) + position) * kHeadDim + t % kHeadDim] = new_kv[t];
  }
  AttentionAcc out{};
  for (int p = item.begin; p < item.end; p += kAttnTile) {
    WaitParity(ring.full_bar(), ring.parity());
    const auto* keys = reinterpret_cast<const __nv_bfloat16*>(ring.tile());
    AttendTile(sh, keys, keys + kValueOffset / 2, Min(kAttnTile, item.end - p), out);
    if (t % 32 == 0) Arrive(ring.empty_bar());
    ++ring.count;
  }
  if (item.last) AttendTile(sh, new_kv, new_kv + kHeadDim, 1, out);

  // This split's unnormalized output and softmax statistics, then the head's last split to finish
  // combines every split's.
  float* part_o = reinterpret_cast<float*>(ws + w.part_o);
  float* part_m = reinterpret_cast<float*>(ws + w.part_m);
  float* part_l = reinterpret_cast<float*>(ws + w.part_l);
  const int slot = item.head * kMaxSplits + item.split;
#ifdef ZEROKV_MEGAKERNEL_QUARTER_PV
  {
    const int h = t >> 7, pair = t & 31, quarter = (t >> 5) & 3;
    auto* partial = reinterpret_cast<float2*>(sh.scratch);
    if (quarter > 0) partial[((quarter - 1) * kGroup + h) * 32 + pair] = out;
    ConsumerSync();
    if (quarter == 0) {
      float2 sum = out;
      for (int q = 0; q < 3; ++q) {
        const float2 other = partial[(q * kGroup + h) * 32 + pair];
        sum.x += other.x;
        sum.y += other.y;
      }
      float* row = part_o + slot * kGroup * kHeadDim + h * kHeadDim + 2 * pair;
      row[0] = sum.x;
      row[1] = sum.y;
    }
  }
#else
  if (t >= 256) sh.score[t - 256] = out;
  ConsumerSync();
  if (t < 256) part_o[slot * kGroup * kHeadDim + t] = out + sh.score[t];
#endif
  if (t < kGroup) {
    part_m[slot * kGroup + t] = sh.max[t];
    part_l[slot * kGroup + t] = sh.sum[t];
  }
  __threadfence();
  ConsumerSync();
  __shared__ int last_to_finish;
  if (t == 0) {
    uint32_t* count = reinterpret_cast<uint32_t*>(ws + w.head_count) + item.head;
    last_to_finish = atomicAdd(count, 1) == static_cast<uint32_t>(item.splits - 1);
    if (last_to_finish) atomicExch(count, 0);
    __threadfence();
  }
  ConsumerSync();
  if (last_to_finish && t < 256) {
    const int h = t >> 6;
    const int first = item.head * kMaxSplits;
    float m = -INFINITY;
    for (int i = 0; i < item.splits; ++i) m = fmaxf(m, Load(part_m + (first + i) * kGroup + h));
    float sum = 0.f, o = 0.f;
    for (int i = 0; i < item.splits; ++i) {
      const float weight = __expf(Load(part_m + (first + i) * kGroup + h) - m);
      sum += weight * Load(part_l + (first + i) * kGroup + h);
      o += weight * Load(part_o + (first + i) * kGroup * kHeadDim + t);
    }
    float* attn = reinterpret_cast<float*>(ws + w.attn);
    attn[item.head * kGroup * kHeadDim + t] = Bf16(o / sum);
  }
}

__device__ void Consume(const LlamaDecodeArgs& a, Ring ring, int position, int64_t token, unsigned char* smem,
                        const Shared& m) {
  const LlamaShape& s = a.shape;
  const Workspace w = WorkspaceLayout(s);
  auto* ws = static_cast<unsigned char*>(a.workspace);
  float* x = reinterpret_cast<float*>(ws + w.x);
  float* qkv = reinterpret_cast<float*>(ws + w.qkv);
  float* h = reinterpret_cast<float*>(ws + w.h);
  auto* count = reinterpret_cast<uint32_t*>(ws + w.barrier_count);
  auto* gen = reinterpret_cast<uint32_t*>(ws + w.barrier_gen);
  float* input = reinterpret_cast<float*>(smem + m.input);
  float* acc = reinterpret_cast<float*>(smem + m.acc);
  float* reduce = reinterpret_cast<float*>(smem + m.reduce);
  float* stats = reinterpret_cast<float*>(smem + m.stats);
  const AttentionShared sh{reinterpret_cast<float*>(smem + m.q), reinterpret_cast<float*>(smem + m.score), stats,
                           stats + kGroup, stats + 2 * kGroup, input};
  auto* new_kv = reinterpret_cast<__nv_bfloat16*>(smem + m.new_kv);
  const __nv_bfloat16* embedding_row = a.embedding + token * s.hidden;
  const AttentionItem item = AttentionItemOf(s, position);
  const int attn_width = s.heads * s.head_dim;
  const int t = threadIdx.x;

  for (int l = 0; l < s.layers; ++l) {
    const LlamaLayer& layer = a.layer[l];
    // qkv = norm(x) . Wqkv
    Rows r = RowsOf(QkvRows(s), l, 0);
    ZeroRows(acc, r.end - r.begin);
    LoadNormed(input, l == 0 ? nullptr : x, embedding_row, layer.input_norm, s.hidden, s.rms_eps, reduce);
    ConsumeSlice(ring, Span(r.end - r.begin, s.hidden), s.hidden, input, acc);
    ConsumerSync();
    for (int i = t; i < r.end - r.begin; i += kConsumerThreads) qkv[r.begin + i] = Bf16(acc[i]);
    GridSync(count, gen);

    if (item.head >= 0) Attention(a, layer, item, position, ring, sh, new_kv, w, ws);
    GridSync(count, gen);

    // x += attn . Wo
    r = RowsOf(s.hidden, l, 2);
    ZeroRows(acc, r.end - r.begin);
    LoadVector(input, reinterpret_cast<const float*>(ws + w.attn), attn_width);
    ConsumeSlice(ring, Span(r.end - r.begin, attn_width), attn_width, input, acc);
    ConsumerSync();
    for (int i = t; i < r.end - r.begin; i += kConsumerThreads) {
      const int row = r.begin + i;
      const float residual = l == 0 ? __bfloat162float(embedding_row[row]) : Load(x + row);
      x[row] = Bf16(residual + Bf16(acc[i]));
    }
    GridSync(count, gen);

    // h = silu(norm(x) . Wgate) * (norm(x) . Wup)
    r = RowsOf(s.ffn, l, 3);
    const int rows = r.end - r.begin;
    ZeroRows(acc, 2 * rows);
    LoadNormed(input, x, nullptr, layer.post_norm, s.hidden, s.rms_eps, reduce);
    ConsumeSlice(ring, Span(rows, s.hidden), s.hidden, input, acc);
    ConsumeSlice(ring, Span(rows, s.hidden), s.hidden, input, acc + rows);
    ConsumerSync();
    for (int i = t; i < rows; i += kConsumerThreads) {
      const float g = Bf16(acc[i]);
      h[r.begin + i] = Bf16(Bf16(g / (1.f + __expf(-g))) * Bf16(acc[rows + i]));
    }
    GridSync(count, gen);

    // x += h . Wdown
    r = RowsOf(s.hidden, l, 4);
    ZeroRows(acc, r.end - r.begin);
    LoadVector(input, h, s.ffn);
    ConsumeSlice(ring, Span(r.end - r.begin, s.ffn), s.ffn, input, acc);
    ConsumerSync();
    for (int i = t; i < r.end - r.begin; i += kConsumerThreads) {
      const int row = r.begin + i;
      x[row] = Bf16(Load(x + row) + Bf16(acc[i]));
    }
    GridSync(count, gen);
  }
  // logits = norm(x) . Wlm
  const Rows r = RowsOf(s.vocab, s.layers, 0);
  ZeroRows(acc, r.end - r.begin);
  LoadNormed(input, x, nullptr, a.final_norm, s.hidden, s.rms_eps, reduce);
  ConsumeSlice(ring, Span(r.end - r.begin, s.hidden), s.hidden, input, acc);
  ConsumerSync();
  for (int i = t; i < r.end - r.begin; i += kConsumerThreads) a.logits[r.begin + i] = __float2bfloat16(acc[i]);
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
    if (threadIdx.x % 32 == 0) Produce(a, ring, static_cast<int>(position));
    return;
  }
  Consume(a, ring, static_cast<int>(position), token, smem, m);
}

int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  return sms;
}

}  // namespace

#ifdef ZEROKV_MEGAKERNEL_TRACE
extern "C" int zerokv_megakernel_trace(uint64_t* out, int* counts) {
  if (cudaMemcpyFromSymbol(out, g_trace, sizeof(g_trace)) != cudaSuccess) return -1;
  if (cudaMemcpyFromSymbol(counts, g_trace_at, sizeof(g_trace_at)) != cudaSuccess) return -1;
  static int zeros[256] = {};
  return cudaMemcpyToSymbol(g_trace_at, zeros, sizeof(zeros)) == cudaSuccess ? 0 : -1;
}
#endif

std::string UnsupportedShape(const LlamaShape& s) {
  if (s.layers < 1 || s.layers > kMaxLayers) {
    return "layers is " + std::to_string(s.layers) + ", not in [1, " + std::to_string(kMaxLayers) + "]";
  }
  if (s.head_dim != kHeadDim) return "head_dim is " + std::to_string(s.head_dim) + ", not 64";
  if (s.kv_heads < 1 || s.heads != kGroup * s.kv_heads) {
    return "heads (" + std::to_string(s.heads) + ") is not 4 x kv_heads (" + std::to_string(s.kv_heads) + ")";
  }
  for (const auto& [name, k] : {std::pair{"hidden", s.hidden}, std::pair{"ffn", s.ffn},
                                std::pair{"heads x head_dim", s.heads * s.head_dim}}) {
    if (k <= 0 || k % kSegment != 0) {
      return std::string(name) + " is " + std::to_string(k) + ", not a multiple of " + std::to_string(kSegment) +
             " (a consumer warp's row segment)";
    }
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
