#include "cc/kvcache/registry.h"

#include <utility>

namespace zerokv::kvcache {

KVCacheRegistry& KVCacheRegistry::Global() {
  static KVCacheRegistry* registry = new KVCacheRegistry();  // never destroyed: used at exit
  return *registry;
}

void KVCacheRegistry::DropExpired() {
  for (auto entry = caches_.begin(); entry != caches_.end();) {
    entry = entry->second.expired() ? caches_.erase(entry) : std::next(entry);
  }
}

Status KVCacheRegistry::Acquire(const std::string& storage_key, const KVCacheConfig& config,
                                std::shared_ptr<DeviceOps> ops, std::shared_ptr<KVCache>* cache) {
  std::lock_guard<std::mutex> lock(mutex_);
  DropExpired();
  auto found = caches_.find(storage_key);
  // A cache whose last holder is being released right now is as good as gone: make a new one.
  std::shared_ptr<KVCache> live = found == caches_.end() ? nullptr : found->second.lock();
  if (live != nullptr) {
    if (live->config() != config) {
      return runtime::InvalidProgram("KV storage '" + storage_key + "' is already held as " +
                                     live->config().ToString() + ", but this delegate needs " +
                                     config.ToString());
    }
    *cache = std::move(live);
    return Status::Ok();
  }
  std::unique_ptr<KVCache> created;
  ZEROKV_RETURN_IF_ERROR(KVCache::Create(config, std::move(ops), &created));
  std::shared_ptr<KVCache> shared(std::move(created));
  caches_[storage_key] = shared;
  *cache = std::move(shared);
  return Status::Ok();
}

std::shared_ptr<KVCache> KVCacheRegistry::Find(const std::string& storage_key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = caches_.find(storage_key);
  return found == caches_.end() ? nullptr : found->second.lock();
}

std::vector<std::shared_ptr<KVCache>> KVCacheRegistry::FindWithPrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<KVCache>> found;
  for (auto entry = caches_.lower_bound(prefix);
       entry != caches_.end() && entry->first.compare(0, prefix.size(), prefix) == 0; ++entry) {
    if (std::shared_ptr<KVCache> live = entry->second.lock()) found.push_back(std::move(live));
  }
  return found;
}

}  // namespace zerokv::kvcache
