#include "cc/kvcache/kv_cache.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace zerokv::kvcache {

using base::CopyKind;
using base::InvalidArgument;
using base::InvalidProgram;

bool KVCacheConfig::operator==(const KVCacheConfig& other) const {
  return dtype == other.dtype && batch == other.batch && heads == other.heads &&
         head_dim == other.head_dim && policy == other.policy && window == other.window &&
         initial_capacity == other.initial_capacity && max_capacity == other.max_capacity &&
         device == other.device && device_id == other.device_id;
}

std::string KVCacheConfig::ToString() const {
  return std::string(blob::ToString(dtype)) + " [" + std::to_string(batch) + ", " +
         std::to_string(heads) + ", positions, " + std::to_string(head_dim) + "] " +
         (policy == blob::KVPolicy::kRing ? "ring window " + std::to_string(window)
                                          : std::string("flat")) +
         " capacity " + std::to_string(initial_capacity) + ".." + std::to_string(max_capacity) +
         " on " + (device == base::ComputeDevice::kCuda ? "cuda:" + std::to_string(device_id)
                                                           : std::string("host"));
}

Status ValidateConfig(const KVCacheConfig& config) {
  if (config.batch == 0 || config.heads == 0 || config.head_dim == 0) {
    return InvalidProgram("KV cache " + config.ToString() +
                          ": batch, heads and head_dim must be positive");
  }
  if (config.policy == blob::KVPolicy::kRing) {
    if (config.window == 0) {
      return InvalidProgram("KV cache " + config.ToString() + ": a ring cache needs a window");
    }
    return Status::Ok();
  }
  if (config.initial_capacity == 0 || config.initial_capacity > config.max_capacity) {
    return InvalidProgram("KV cache " + config.ToString() +
                          ": needs 0 < initial_capacity <= max_capacity");
  }
  return Status::Ok();
}

Status PlanCapacity(const KVCacheConfig& config, uint64_t capacity, uint64_t length, uint64_t step,
                    uint64_t* planned) {
  if (config.policy == blob::KVPolicy::kRing) {
    if (step > config.window) {
      return InvalidArgument("a step of " + std::to_string(step) +
                             " tokens is wider than the ring cache's window of " +
                             std::to_string(config.window) +
                             ": it would overwrite its own positions");
    }
    *planned = config.window;
    return Status::Ok();
  }
  if (step > std::numeric_limits<uint64_t>::max() - length ||
      length + step > config.max_capacity) {
    return InvalidArgument("a step of " + std::to_string(step) + " tokens after " +
                           std::to_string(length) + " would exceed the KV cache's max_capacity of " +
                           std::to_string(config.max_capacity) + " positions");
  }
  const uint64_t needed = length + step;
  uint64_t grown = capacity == 0 ? config.initial_capacity : capacity;
  while (grown < needed) {
    grown = grown > config.max_capacity / 2 ? config.max_capacity : grown * 2;
  }
  *planned = grown;
  return Status::Ok();
}

uint64_t CommittedLength(const KVCacheConfig& config, uint64_t length, uint64_t step) {
  if (config.policy == blob::KVPolicy::kRing) return std::min(length + step, config.window);
  return length + step;
}

KVCache::KVCache(const KVCacheConfig& config, std::shared_ptr<DeviceOps> ops)
    : config_(config), ops_(std::move(ops)) {}

Status KVCache::Create(const KVCacheConfig& config, std::shared_ptr<DeviceOps> ops,
                       std::unique_ptr<KVCache>* cache) {
  ZEROKV_RETURN_IF_ERROR(ValidateConfig(config));
  std::unique_ptr<KVCache> created(new KVCache(config, std::move(ops)));
  ZEROKV_RETURN_IF_ERROR(created->ops_->CreateEvent(&created->last_use_));
  *cache = std::move(created);
  return Status::Ok();
}

KVCache::~KVCache() {
  if (used_) {
    Status drained = ops_->SynchronizeEvent(last_use_);
    (void)drained;  // Nobody to report to; the storage must be released either way.
  }
  // Ordered after the last use by the synchronization above.
  for (void* storage : {k_, v_}) {
    if (storage) (void)ops_->FreeAsync(storage, nullptr);
  }
  if (reserve_capacity_ != 0) (void)ReleaseReserve(nullptr);
  if (retired_capacity_ != 0) (void)FreePair(retired_, nullptr);
  if (last_use_) ops_->DestroyEvent(last_use_);
}

size_t KVCache::position_bytes() const {
  return static_cast<size_t>(config_.batch * config_.heads * config_.head_dim) *
         blob::ElementBytes(config_.dtype);
}

size_t KVCache::row_bytes(uint64_t capacity) const {
  return static_cast<size_t>(capacity * config_.head_dim) * blob::ElementBytes(config_.dtype);
}

Status KVCache::BeginStep(uint64_t step, uint64_t* position) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (held_) {
    return base::InvalidState(
        "another step or a reset of this KV cache is in flight: steps of one sequence must not "
        "overlap");
  }
  uint64_t planned = 0;
  ZEROKV_RETURN_IF_ERROR(PlanCapacity(config_, capacity_, length_, step, &planned));
  held_ = true;
  held_step_ = step;
  *position = position_;
  return Status::Ok();
}

Status KVCache::Prepare(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!held_) return base::Internal("KVCache::Prepare without BeginStep");
  uint64_t planned = 0;
  ZEROKV_RETURN_IF_ERROR(PlanCapacity(config_, capacity_, length_, held_step_, &planned));
  if (used_) ZEROKV_RETURN_IF_ERROR(ops_->StreamWaitEvent(stream, last_use_));
  ordered_ = true;
  if (zero_pending_) {
    const size_t bytes = position_bytes() * static_cast<size_t>(capacity_);
    ZEROKV_RETURN_IF_ERROR(ops_->Zero(k_, bytes, stream));
    ZEROKV_RETURN_IF_ERROR(ops_->Zero(v_, bytes, stream));
    zero_pending_ = false;
  }
  if (planned != capacity_) ZEROKV_RETURN_IF_ERROR(Reallocate(planned, stream));
  return Status::Ok();
}

// Takes the reserve when it has exactly `capacity` (else allocates and zeroes K and V there),
// copies the old contents into their first positions (those the reserve does not hold yet), and
// only then swaps them in and frees the old storage on the same stream (retires it, when the growth
// took the reserve). Any failure before the swap releases the new storage instead (the reserve too:
// the copy may have written into it).
Status KVCache::Reallocate(uint64_t capacity, StreamHandle stream) {
  // Not the growth's failure if it fails: the storage is forgotten either way.
  if (retired_capacity_ != 0) {
    retired_capacity_ = 0;
    (void)FreePair(retired_, stream);
  }
  void* grown[2] = {nullptr, nullptr};
  uint64_t carried = 0;  // positions the new storage holds already
  const bool onto_reserve = reserve_capacity_ == capacity;
  if (onto_reserve) {
    std::swap(grown, reserve_);
    carried = reserve_rows_;
    reserve_capacity_ = 0;
    reserve_rows_ = 0;
  } else {
    // A reserve of another capacity would only be held for a later growth that never comes: the
    // capacities double from this one on.
    if (reserve_capacity_ != 0) ZEROKV_RETURN_IF_ERROR(ReleaseReserve(stream));
    ZEROKV_RETURN_IF_ERROR(AllocateZeroed(capacity, stream, "growing a KV cache to", grown));
  }
  void* const old[2] = {k_, v_};
  // Through the old capacity, not only the committed length: after a reset that forgot what the
  // reserve carried (carried 0), every position it holds is overwritten.
  Status status = CopyPositions(grown, capacity, old, capacity_, carried, capacity_, stream);
  if (!status.ok()) {
    for (void* storage : grown) (void)ops_->FreeAsync(storage, stream);
    return status;
  }
  if (k_ != nullptr) {
    ++growths_;
    bytes_moved_ += 2 * position_bytes() * static_cast<size_t>(capacity_);
  }
  const uint64_t old_capacity = capacity_;
  k_ = grown[0];
  v_ = grown[1];
  capacity_ = capacity;
  if (onto_reserve && old[0] != nullptr) {
    retired_[0] = old[0];
    retired_[1] = old[1];
    retired_capacity_ = old_capacity;
    retired_in_step_ = true;
    return Status::Ok();
  }
  for (void* storage : old) {
    if (storage) ZEROKV_RETURN_IF_ERROR(ops_->FreeAsync(storage, stream));
  }
  return Status::Ok();
}

Status KVCache::AllocateZeroed(uint64_t capacity, StreamHandle stream, const std::string& why,
                               void* (&storage)[2]) {
  const size_t bytes = position_bytes() * static_cast<size_t>(capacity);
  Status status = Status::Ok();
  for (int i = 0; i < 2 && status.ok(); ++i) {
    status = ops_->AllocateAsync(bytes, stream, &storage[i]);
    if (!status.ok()) {
      storage[i] = nullptr;
      status = Status(status.code(), why + " " + std::to_string(capacity) + " positions (" +
                                         std::to_string(bytes) +
                                         " bytes each for K and V): " + status.message());
      break;
    }
    status = ops_->Zero(storage[i], bytes, stream);
  }
  if (!status.ok()) {
    for (void*& allocated : storage) {
      if (allocated) (void)ops_->FreeAsync(allocated, stream);
      allocated = nullptr;
    }
  }
  return status;
}

Status KVCache::CopyPositions(void* const (&to)[2], uint64_t to_capacity, void* const (&from)[2],
                              uint64_t from_capacity, uint64_t first, uint64_t end,
                              StreamHandle stream) {
  if (end <= first) return Status::Ok();
  const size_t rows = static_cast<size_t>(config_.batch * config_.heads);
  const size_t offset = row_bytes(first);
  for (int i = 0; i < 2; ++i) {
    if (from[i] == nullptr) continue;
    ZEROKV_RETURN_IF_ERROR(ops_->Copy2D(static_cast<char*>(to[i]) + offset, row_bytes(to_capacity),
                                        static_cast<const char*>(from[i]) + offset,
                                        row_bytes(from_capacity), row_bytes(end - first), rows,
                                        CopyKind::kDeviceToDevice, stream));
  }
  return Status::Ok();
}

Status KVCache::FreePair(void* (&storage)[2], StreamHandle stream) {
  Status status = Status::Ok();
  for (void*& tensor : storage) {
    Status freed = ops_->FreeAsync(tensor, stream);
    if (status.ok()) status = freed;
    tensor = nullptr;
  }
  return status;
}

Status KVCache::ReleaseReserve(StreamHandle stream) {
  reserve_capacity_ = 0;
  reserve_rows_ = 0;
  return FreePair(reserve_, stream);
}

Status KVCache::ReleaseRetired(StreamHandle stream, bool* released) {
  std::lock_guard<std::mutex> lock(mutex_);
  *released = false;
  // Only the step's Prepare orders `stream` after the retired storage's last use (the growth's
  // copy).
  if (!ordered_) return base::Internal("KVCache::ReleaseRetired outside a held step's Prepare");
  if (retired_capacity_ == 0 || retired_in_step_) return Status::Ok();
  retired_capacity_ = 0;
  ZEROKV_RETURN_IF_ERROR(FreePair(retired_, stream));
  *released = true;
  return Status::Ok();
}

Status KVCache::PrepareGrowth(uint64_t lookahead, StreamHandle stream, bool* prepared) {
  std::lock_guard<std::mutex> lock(mutex_);
  *prepared = false;
  // Outside a step nothing would order the reserve's zeroing and filling before another stream's
  // use of it, and before the step's Prepare nothing orders its copy after the last use.
  if (!ordered_) return base::Internal("KVCache::PrepareGrowth outside a held step's Prepare");
  if (config_.policy != blob::KVPolicy::kFlat || k_ == nullptr || reserve_capacity_ != 0 ||
      capacity_ == config_.max_capacity || lookahead <= capacity_ - length_) {
    return Status::Ok();
  }
  // The capacity the first step past this one plans, the growth a decode step meets.
  uint64_t next = 0;
  ZEROKV_RETURN_IF_ERROR(PlanCapacity(config_, capacity_, capacity_, 1, &next));
  ZEROKV_RETURN_IF_ERROR(
      AllocateZeroed(next, stream, "preparing a KV cache's growth to", reserve_));
  reserve_capacity_ = next;
  // Committed positions are never written again: they are carried into the reserve now, so that
  // the growth copies only the positions committed since (the reserve is taken within `lookahead`).
  void* const current[2] = {k_, v_};
  Status carried = CopyPositions(reserve_, next, current, capacity_, 0, length_, stream);
  if (!carried.ok()) {
    (void)ReleaseReserve(stream);
    return Status(carried.code(), "carrying a KV cache's committed positions into its prepared growth: " +
                                      carried.message());
  }
  reserve_rows_ = length_;
  *prepared = true;
  return Status::Ok();
}

Status KVCache::MarkUsed(StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Re-recorded on a stream that never waited for it, the event would no longer cover the last use:
  // a later step could then free or overwrite what that use still reads.
  if (used_ && !ordered_) ZEROKV_RETURN_IF_ERROR(ops_->StreamWaitEvent(stream, last_use_));
  ZEROKV_RETURN_IF_ERROR(ops_->RecordEvent(last_use_, stream));
  used_ = true;
  return Status::Ok();
}

Status KVCache::LastUseFinished() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!ordered_) return base::Internal("KVCache::LastUseFinished outside a held step's Prepare");
  used_ = false;
  return Status::Ok();
}

void KVCache::EndStep(bool commit) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (commit) {
    length_ = CommittedLength(config_, length_, held_step_);
    position_ += held_step_;
  }
  held_ = false;
  held_step_ = 0;
  ordered_ = false;
  retired_in_step_ = false;
}

Status KVCache::BeginReset() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (held_) {
    return base::InvalidState("a step or another reset of this KV cache is in flight");
  }
  held_ = true;
  return Status::Ok();
}

void KVCache::EndReset(bool reset) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (reset) {
    length_ = 0;
    position_ = 0;
    zero_pending_ = k_ != nullptr;
    reserve_rows_ = 0;  // what it carried is forgotten: the growth copies every position over it
  }
  held_ = false;
}

void* KVCache::k() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return k_;
}

void* KVCache::v() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return v_;
}

std::vector<int64_t> KVCache::shape() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ShapeAt(capacity_);
}

std::vector<int64_t> KVCache::ShapeAt(uint64_t capacity) const {
  return {static_cast<int64_t>(config_.batch), static_cast<int64_t>(config_.heads),
          static_cast<int64_t>(capacity), static_cast<int64_t>(config_.head_dim)};
}

bool KVCache::Reserve(CacheStorage* reserve) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (reserve_capacity_ == 0) return false;
  *reserve = {reserve_[0], reserve_[1], ShapeAt(reserve_capacity_),
              position_bytes() * static_cast<size_t>(reserve_capacity_)};
  return true;
}

size_t KVCache::bytes_per_tensor() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return position_bytes() * static_cast<size_t>(capacity_);
}

KVCacheMetrics KVCache::metrics() const {
  std::lock_guard<std::mutex> lock(mutex_);
  KVCacheMetrics metrics;
  metrics.bytes_reserved =
      2 * position_bytes() * (capacity_ + reserve_capacity_ + retired_capacity_);
  metrics.bytes_in_use = 2 * position_bytes() * length_;
  metrics.growths = growths_;
  metrics.bytes_moved = bytes_moved_;
  metrics.length = length_;
  metrics.capacity = capacity_;
  metrics.position = position_;
  return metrics;
}

}  // namespace zerokv::kvcache
