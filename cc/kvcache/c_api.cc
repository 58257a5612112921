#include "cc/kvcache/c_api.h"

#include <memory>

#include <executorch/runtime/platform/log.h>

#include "cc/kvcache/sequence.h"

// A handle is a heap-held reference to the sequence.
struct ZeroKVSequence {
  std::shared_ptr<zerokv::kvcache::Sequence> sequence;
};

namespace {

ZeroKVSequence* Handle(std::shared_ptr<zerokv::kvcache::Sequence> sequence) {
  return sequence == nullptr ? nullptr : new ZeroKVSequence{std::move(sequence)};
}

}  // namespace

extern "C" ZeroKVSequence* zerokv_kv_sequence_create(void) {
  return Handle(zerokv::kvcache::Sequence::Create());
}

extern "C" ZeroKVSequence* zerokv_kv_implicit_sequence(void) {
  return Handle(zerokv::kvcache::Sequence::FindImplicit());
}

extern "C" void zerokv_kv_sequence_release(ZeroKVSequence* sequence) { delete sequence; }

extern "C" void zerokv_kv_sequence_select(ZeroKVSequence* sequence) {
  zerokv::kvcache::SelectSequence(sequence == nullptr ? nullptr : sequence->sequence);
}

extern "C" int zerokv_kv_sequence_metrics(const ZeroKVSequence* sequence, ZeroKVCacheMetrics* out) {
  if (sequence == nullptr || out == nullptr) return 0;
  size_t caches = 0;
  const zerokv::kvcache::KVCacheMetrics metrics = sequence->sequence->Metrics(&caches);
  *out = ZeroKVCacheMetrics{metrics.bytes_reserved, metrics.bytes_in_use, metrics.growths,
                            metrics.bytes_moved,    metrics.length,       metrics.capacity,
                            metrics.position};
  return static_cast<int>(caches);
}

extern "C" int zerokv_kv_sequence_reset(ZeroKVSequence* sequence) {
  if (sequence == nullptr) return -1;
  zerokv::base::Status status = sequence->sequence->Reset();
  if (status.ok()) return 0;
  ET_LOG(Error, "zerokv_kv_sequence_reset: %s", status.message().c_str());
  return -1;
}
