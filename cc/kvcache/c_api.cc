#include "cc/kvcache/c_api.h"

#include <memory>
#include <string>

#include "cc/kvcache/registry.h"

namespace {

using zerokv::kvcache::KVCache;
using zerokv::kvcache::KVCacheMetrics;
using zerokv::kvcache::KVCacheRegistry;

void Add(const KVCacheMetrics& metrics, ZeroKVCacheMetrics* out) {
  out->bytes_reserved += metrics.bytes_reserved;
  out->bytes_in_use += metrics.bytes_in_use;
  out->growths += metrics.growths;
  out->bytes_moved += metrics.bytes_moved;
  out->length += metrics.length;
  out->capacity += metrics.capacity;
}

}  // namespace

extern "C" int zerokv_kv_metrics(const char* storage_key, ZeroKVCacheMetrics* out) {
  if (storage_key == nullptr || out == nullptr) return -1;
  std::shared_ptr<KVCache> cache = KVCacheRegistry::Global().Find(storage_key);
  if (cache == nullptr) return -1;
  *out = ZeroKVCacheMetrics{};
  Add(cache->metrics(), out);
  return 0;
}

extern "C" int zerokv_kv_metrics_sum(const char* key_prefix, ZeroKVCacheMetrics* out) {
  if (key_prefix == nullptr || out == nullptr) return 0;
  *out = ZeroKVCacheMetrics{};
  int summed = 0;
  for (const std::shared_ptr<KVCache>& cache : KVCacheRegistry::Global().FindWithPrefix(key_prefix)) {
    Add(cache->metrics(), out);
    ++summed;
  }
  return summed;
}

extern "C" int zerokv_kv_reset(const char* storage_key) {
  if (storage_key == nullptr) return -1;
  std::shared_ptr<KVCache> cache = KVCacheRegistry::Global().Find(storage_key);
  if (cache == nullptr) return -1;
  cache->Reset();
  return 0;
}

extern "C" int zerokv_kv_reset_prefix(const char* key_prefix) {
  if (key_prefix == nullptr) return 0;
  int reset = 0;
  for (const std::shared_ptr<KVCache>& cache : KVCacheRegistry::Global().FindWithPrefix(key_prefix)) {
    cache->Reset();
    ++reset;
  }
  return reset;
}
