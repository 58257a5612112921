#include "cc/kvcache/sequence.h"

#include <atomic>
#include <vector>

namespace zerokv::kvcache {
namespace {

std::atomic<uint64_t> next_id{1};

// Defined once, in this file, so that every delegate linked with it reads the same variable.
thread_local std::shared_ptr<Sequence> current;

std::mutex implicit_mutex;
std::weak_ptr<Sequence>& ImplicitSlot() {
  static std::weak_ptr<Sequence>* slot = new std::weak_ptr<Sequence>();  // used at exit
  return *slot;
}

}  // namespace

std::shared_ptr<Sequence> Sequence::Create() {
  return std::shared_ptr<Sequence>(new Sequence(next_id++, /*implicit=*/false));
}

std::shared_ptr<Sequence> Sequence::Implicit() {
  std::lock_guard<std::mutex> lock(implicit_mutex);
  std::shared_ptr<Sequence> live = ImplicitSlot().lock();
  if (live == nullptr) {
    live = std::shared_ptr<Sequence>(new Sequence(next_id++, /*implicit=*/true));
    ImplicitSlot() = live;
  }
  return live;
}

std::shared_ptr<Sequence> Sequence::FindImplicit() {
  std::lock_guard<std::mutex> lock(implicit_mutex);
  return ImplicitSlot().lock();
}

Status Sequence::Acquire(const std::string& storage_key, const KVCacheConfig& config,
                         std::shared_ptr<DeviceOps> ops, std::shared_ptr<KVCache>* cache) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = caches_.find(storage_key);
  if (found != caches_.end()) {
    if (found->second->config() != config) {
      return base::InvalidProgram("KV storage '" + storage_key + "' is already held as " +
                                     found->second->config().ToString() +
                                     ", but this delegate needs " + config.ToString());
    }
    *cache = found->second;
    return Status::Ok();
  }
  std::unique_ptr<KVCache> created;
  ZEROKV_RETURN_IF_ERROR(KVCache::Create(config, std::move(ops), &created));
  std::shared_ptr<KVCache> shared(std::move(created));
  caches_.emplace(storage_key, shared);
  *cache = std::move(shared);
  return Status::Ok();
}

std::shared_ptr<KVCache> Sequence::Find(const std::string& storage_key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = caches_.find(storage_key);
  return found == caches_.end() ? nullptr : found->second;
}

Status Sequence::Claim(const std::string& method, const std::string& storage_key) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (implicit_ && claims_.count({method, storage_key}) != 0) {
    return base::InvalidState(
        "a loaded '" + method + "' delegate already uses KV storage '" + storage_key +
        "' without a sequence of its own: this is a second loaded instance of the program, and "
        "it would write the first one's caches. Load each instance under a sequence of its own "
        "(zerokv::kvcache::SequenceGuard, or zerokv_kv_sequence_select from the C API)");
  }
  claims_.emplace(method, storage_key);
  return Status::Ok();
}

void Sequence::Release(const std::string& method, const std::string& storage_key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = claims_.find({method, storage_key});
  if (found != claims_.end()) claims_.erase(found);
}

Status Sequence::Reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<KVCache*> held;
  for (const auto& [storage_key, cache] : caches_) {
    Status status = cache->BeginReset();
    if (!status.ok()) {
      for (KVCache* other : held) other->EndReset(/*reset=*/false);
      return Status(status.code(), "cannot reset the sequence: KV storage '" + storage_key +
                                       "': " + status.message() + "; nothing was reset");
    }
    held.push_back(cache.get());
  }
  for (KVCache* cache : held) cache->EndReset(/*reset=*/true);
  return Status::Ok();
}

KVCacheMetrics Sequence::Metrics(size_t* caches) const {
  std::lock_guard<std::mutex> lock(mutex_);
  KVCacheMetrics sum;
  for (const auto& entry : caches_) {
    const KVCacheMetrics metrics = entry.second->metrics();
    sum.bytes_reserved += metrics.bytes_reserved;
    sum.bytes_in_use += metrics.bytes_in_use;
    sum.growths += metrics.growths;
    sum.bytes_moved += metrics.bytes_moved;
    sum.length += metrics.length;
    sum.capacity += metrics.capacity;
    sum.position += metrics.position;
  }
  if (caches != nullptr) *caches = caches_.size();
  return sum;
}

std::shared_ptr<Sequence> CurrentSequence() { return current; }

std::shared_ptr<Sequence> SelectSequence(std::shared_ptr<Sequence> sequence) {
  std::shared_ptr<Sequence> previous = std::move(current);
  current = std::move(sequence);
  return previous;
}

}  // namespace zerokv::kvcache
