// KVCacheRegistry: the runtime-owned KV caches alive in this process, by storage key.
//
// Delegates whose KV layers name the same storage_key share that layer's cache: the prefill and
// decode methods of one program write and read one storage. A cache lives as long as some delegate
// holds it (shared_ptr) and is released with the last one. zerokv's exporter makes keys unique per
// exported program, so two programs never share; two loaded instances of the *same* program do
// share their caches (load a program once per conversation, or Reset between them).
//
//   std::shared_ptr<KVCache> cache;
//   ZEROKV_RETURN_IF_ERROR(KVCacheRegistry::Global().Acquire(key, config, ops, &cache));
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/kvcache/kv_cache.h"

namespace zerokv::kvcache {

class KVCacheRegistry {
 public:
  static KVCacheRegistry& Global();

  // The live cache named `storage_key`, or a new one created with `config` and `ops`. A live
  // cache with another config (shape, dtype, policy, capacities, device) is refused: two delegates
  // would bind one storage at different layouts.
  Status Acquire(const std::string& storage_key, const KVCacheConfig& config,
                 std::shared_ptr<DeviceOps> ops, std::shared_ptr<KVCache>* cache);

  // The live cache named `storage_key`, or nullptr.
  std::shared_ptr<KVCache> Find(const std::string& storage_key);

  // Every live cache whose key starts with `prefix` (all of them for "").
  std::vector<std::shared_ptr<KVCache>> FindWithPrefix(const std::string& prefix);

 private:
  void DropExpired();  // with mutex_ held

  std::mutex mutex_;
  std::map<std::string, std::weak_ptr<KVCache>> caches_;
};

}  // namespace zerokv::kvcache
