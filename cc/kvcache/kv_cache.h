// KVCache: one layer's runtime-owned K and V storage, each laid out [batch, heads, capacity,
// head_dim], in device memory (CUDA) or host memory through one allocator interface (DeviceOps).
//
// The delegate drives it around every engine run:
//
//   uint64_t position;
//   ZEROKV_RETURN_IF_ERROR(cache.BeginStep(step, &position));  // every cache, before anything is touched
//   ZEROKV_RETURN_IF_ERROR(cache.Prepare(stream));
//   ...bind cache.k() / cache.v() at cache.shape(), fill the step's positions, enqueue on `stream`...
//   bool prepared, released;
//   if (run_ok) (void)cache.PrepareGrowth(lookahead, stream, &prepared);  // optional; see below
//   if (run_ok) (void)cache.ReleaseRetired(stream, &released);            // see below
//   cache.MarkUsed(stream);                                    // whether the run succeeded or not
//   if (synchronized) (void)cache.LastUseFinished();           // the host finished `stream` after it
//   cache.EndStep(/*commit=*/run_ok);                          // only a successful run advances
//
// Positions belong to the cache, never to the caller: a step writes [position, position + step),
// where `position` counts the tokens committed since the last reset (BeginStep hands it out; the
// runtime fills the engine's positions input with it), and a ring writes them modulo its window.
// A refused or failed step commits nothing, so its retry writes the same positions again: no gap,
// and nothing committed is overwritten.
//
// Flat caches grow geometrically: when length + step exceeds the capacity, the capacity doubles
// (as often as needed, capped at max_capacity) and the old contents are copied into the new
// storage on the step's stream, the old storage released only after that copy (stream-ordered
// allocation, DeviceOps::AllocateAsync / FreeAsync). Beyond max_capacity a step is refused.
//
// A growth may be prepared ahead, because allocating fresh device memory costs the host time
// (cudaMallocAsync: about 75 us per 64 MiB on an H200) and a model's layers all grow in the same
// step: PrepareGrowth, within `lookahead` positions of the capacity, allocates and zeroes the next
// capacity's storage (the doubling a one-token growth plans, capped at max_capacity), copies the
// committed positions into it (they are never written again) and keeps it aside as a reserve; the
// growth to exactly that capacity then only copies the positions committed since. A growth to
// another capacity (a wide step jumping further) releases the reserve and allocates as usual. The
// reserve counts in bytes_reserved, survives a reset (the growth then copies every position over
// what it carried) and is released with the cache. Its cost is memory: from its reservation to the growth a
// cache holds its next capacity besides its current one. A caller spreads the reserves of its
// caches over several steps so that no step pays for every layer's next capacity at once (the
// delegate: one per step).
// A growth onto the reserve does not release the storage it replaces either: it retires it.
// cudaFreeAsync returns memory to the device's pool, and the pool gives what it holds unused back
// to the system at the next synchronization (its release threshold is 0 by default): the growth
// step's own end, for every layer at once. (On the H200, with the release moved out of it, the 1B
// bench's slowest growth step went from 2.06-2.2x the median step to 1.62x, on other loans:
// tools/bench/decode_roofline_notes.md.)
// ReleaseRetired, in a later step, releases it (the delegate: one cache per step); the next growth
// and the cache's destruction release what is still retired. It costs memory too: the old
// capacity, held from the growth until then, and counted in bytes_reserved.
// Ring caches hold `window` positions from the start and never grow; their length saturates at
// the window (their position does not), and a step wider than the window is refused.
//
// Storage is allocated on the first Prepare (on the stream that first uses it) and zeroed there:
// masked positions still enter attention as 0 * value, and uninitialized memory may hold NaN.
//
// Streams: the cache may be used from several streams (the prefill and decode delegates of one
// program share it). Prepare orders its stream after the cache's last recorded use (an event, no
// host block); MarkUsed records that use. A caller that has finished the step's stream on the host
// after its MarkUsed (the delegate on its own stream, every step) says so with LastUseFinished: no
// use is then pending, and the next Prepare orders nothing (one CUDA call fewer per cache, before
// the run). PrepareGrowth runs inside the held step, on its stream, before its MarkUsed, so that
// the event orders the reserve's zeroing and filling before any later use too.
//
// Thread safety: every method locks the cache. A step (BeginStep .. EndStep) or a reset
// (BeginReset .. EndReset) holds the cache: another step or reset meanwhile is refused, so two
// threads never interleave steps of one cache and a reset never lands inside a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/base/device_ops.h"
#include "cc/base/status.h"
#include "cc/blob/blob.h"

namespace zerokv::kvcache {

using base::DeviceOps;
using base::EventHandle;
using base::Status;
using base::StreamHandle;

struct KVCacheConfig {
  blob::DType dtype = blob::DType::kBfloat16;
  uint64_t batch = 1;
  uint64_t heads = 0;
  uint64_t head_dim = 0;
  blob::KVPolicy policy = blob::KVPolicy::kFlat;
  uint64_t window = 0;            // ring only: the positions kept
  uint64_t initial_capacity = 0;  // flat only: positions allocated by the first step (at least)
  uint64_t max_capacity = 0;      // flat only: positions a step may never exceed
  // Where the storage lives; caches shared by several delegates must agree on it.
  base::ComputeDevice device = base::ComputeDevice::kHost;
  int device_id = 0;

  bool operator==(const KVCacheConfig& other) const;
  bool operator!=(const KVCacheConfig& other) const { return !(*this == other); }
  std::string ToString() const;
};

// Checks that a config describes a cache this manager can hold (positive sizes, ordered
// capacities, a ring with a window), naming the field at fault.
Status ValidateConfig(const KVCacheConfig& config);

// The capacity (positions) that holds `length + step` positions, starting from `capacity`: flat
// caches double (capped at max_capacity), ring caches keep their window. Refuses a flat step past
// max_capacity and a ring step wider than the window. `capacity` 0 means "not allocated yet" and
// starts from initial_capacity (flat) or window (ring).
Status PlanCapacity(const KVCacheConfig& config, uint64_t capacity, uint64_t length, uint64_t step,
                    uint64_t* planned);

// The length after committing `step` tokens: length + step, saturated at the window for a ring.
uint64_t CommittedLength(const KVCacheConfig& config, uint64_t length, uint64_t step);

// Memory accounting over K and V together.
struct KVCacheMetrics {
  uint64_t bytes_reserved = 0;  // storage allocated now: a reserve and retired storage included
  uint64_t bytes_in_use = 0;    // committed positions
  uint64_t growths = 0;         // reallocations that preserved contents
  uint64_t bytes_moved = 0;     // bytes of old storage they carried over (at the growth or ahead)
  uint64_t length = 0;          // committed positions held (a ring's stops at its window)
  uint64_t capacity = 0;        // allocated positions (0 before the first step)
  uint64_t position = 0;        // tokens committed since the last reset: the next step's first position
};

// Where a cache's K and V are bound: their addresses, their shape [batch, heads, capacity, head_dim]
// and the bytes of each.
struct CacheStorage {
  void* k = nullptr;
  void* v = nullptr;
  std::vector<int64_t> shape;
  size_t bytes_per_tensor = 0;
};

class KVCache {
 public:
  // `ops` allocates and copies on config.device; it is shared with the delegate that created the
  // cache and outlives both. Allocates nothing yet.
  static Status Create(const KVCacheConfig& config, std::shared_ptr<DeviceOps> ops,
                       std::unique_ptr<KVCache>* cache);

  // Waits for the last recorded use, then releases the storage.
  ~KVCache();

  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  // Holds the cache for a step of `step` tokens and sets `position` to its first position. Refused,
  // with nothing changed, when the step does not fit (PlanCapacity) or a step or reset holds the
  // cache already.
  Status BeginStep(uint64_t step, uint64_t* position);

  // Makes room for the held step, on `stream`: orders it after the last use, allocates or grows the
  // storage, zeroes it after a reset. On failure the old storage, its contents and the length are
  // intact.
  Status Prepare(StreamHandle stream);

  // Prepares the growth ahead, within a held step after its Prepare and before its MarkUsed, on
  // the step's `stream` (refused anywhere else): for an allocated flat cache below max_capacity
  // without a reserve, whose committed length (the held step not counted) + `lookahead` exceeds
  // its capacity, allocates and zeroes the next capacity's K and V, copies the committed positions
  // into them and keeps them as the reserve. `prepared` says whether it allocated. Changes nothing
  // a step binds (k, v, shape, capacity). On failure it holds nothing new, and the growth
  // allocates when it comes, as without a reserve.
  Status PrepareGrowth(uint64_t lookahead, StreamHandle stream, bool* prepared);

  // Releases the storage a growth onto the reserve retired, within a held step after its Prepare
  // and before its MarkUsed, on the step's `stream` (refused anywhere else: only the Prepare orders
  // the stream after the storage's last use), unless the held step is the growth's own. `released`
  // says whether it released anything.
  Status ReleaseRetired(StreamHandle stream, bool* released);

  // Records that work using the storage was enqueued on `stream`; later Prepares wait for it. In a
  // step whose Prepare did not run or failed before ordering `stream`, it orders `stream` after the
  // last use first, so that the recorded use still covers every earlier one.
  Status MarkUsed(StreamHandle stream);

  // The host synchronized the held step's stream after its Prepare and MarkUsed: every use of the
  // storage so far has finished, so the next Prepare need not order its stream after one. Refused
  // outside a held step's Prepare (a use on another stream could still be running).
  Status LastUseFinished();

  // Releases the held step; `commit` (the run wrote its positions) advances the length and the
  // position by its tokens.
  void EndStep(bool commit);

  // A reset in two phases, so that a sequence resets all of its caches or none: BeginReset holds
  // the cache (refused while a step or reset holds it); EndReset(true) forgets every committed
  // position (the storage is kept and zeroed by the next Prepare), EndReset(false) changes nothing.
  Status BeginReset();
  void EndReset(bool reset);

  // The storage for the next run (valid from Prepare until the next Prepare).
  void* k() const;
  void* v() const;
  // [batch, heads, capacity, head_dim]: what the engine binding is bound at.
  std::vector<int64_t> shape() const;
  // Bytes of one of K and V.
  size_t bytes_per_tensor() const;

  // The storage the growth prepared ahead will bind (the reserve, at its capacity), so that
  // a caller can ready an engine for it before the growth; false when the cache holds no reserve.
  bool Reserve(CacheStorage* reserve) const;

  KVCacheMetrics metrics() const;
  const KVCacheConfig& config() const { return config_; }

 private:
  KVCache(const KVCacheConfig& config, std::shared_ptr<DeviceOps> ops);

  // Bytes of one position of one of K and V, over batch and heads.
  size_t position_bytes() const;
  size_t row_bytes(uint64_t capacity) const;  // one (batch, head) row at `capacity` positions
  std::vector<int64_t> ShapeAt(uint64_t capacity) const;
  Status Reallocate(uint64_t capacity, StreamHandle stream);
  // Allocates and zeroes K and V of `capacity` positions into `storage`, on `stream`; on failure
  // releases what it allocated. `why` begins the error message.
  Status AllocateZeroed(uint64_t capacity, StreamHandle stream, const std::string& why,
                        void* (&storage)[2]);
  // Copies positions [first, end) of every (batch, head) row of K and V in `from` (rows of
  // `from_capacity` positions; nullptr: nothing) into `to` (rows of `to_capacity`), on `stream`.
  Status CopyPositions(void* const (&to)[2], uint64_t to_capacity, void* const (&from)[2],
                       uint64_t from_capacity, uint64_t first, uint64_t end, StreamHandle stream);
  // Releases K and V in `storage` on `stream` and forgets them, even when a release fails.
  Status FreePair(void* (&storage)[2], StreamHandle stream);
  // Releases the reserve on `stream`.
  Status ReleaseReserve(StreamHandle stream);

  const KVCacheConfig config_;
  const std::shared_ptr<DeviceOps> ops_;
  mutable std::mutex mutex_;
  void* k_ = nullptr;
  void* v_ = nullptr;
  uint64_t capacity_ = 0;
  void* reserve_[2] = {nullptr, nullptr};  // K and V for the growth to reserve_capacity_, zeroed
  uint64_t reserve_capacity_ = 0;          // 0: no reserve
  uint64_t reserve_rows_ = 0;              // positions [0, reserve_rows_) carried into it already
  void* retired_[2] = {nullptr, nullptr};  // K and V a growth onto the reserve replaced
  uint64_t retired_capacity_ = 0;          // 0: nothing retired
  bool retired_in_step_ = false;           // by the held step's growth
  uint64_t length_ = 0;
  uint64_t position_ = 0;
  bool held_ = false;         // a step or a reset is between its Begin and End
  uint64_t held_step_ = 0;    // the held step's tokens
  bool ordered_ = false;      // the held step's stream waits for the last use (its Prepare did)
  bool zero_pending_ = false;
  EventHandle last_use_ = nullptr;
  bool used_ = false;  // last_use_ has been recorded
  uint64_t growths_ = 0;
  uint64_t bytes_moved_ = 0;
};

}  // namespace zerokv::kvcache
