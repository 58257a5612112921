// The blob that tests/blob/make_fixtures.py calls caller_kv_blob(), built through the C++ API: the
// cross-language tests check that each side reads the other's bytes of it field for field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cc/blob/blob.h"

namespace zerokv::blob::testing {

inline const std::vector<uint8_t>& ExamplePayload() {
  static const std::vector<uint8_t> payload = [] {
    std::vector<uint8_t> bytes;
    for (int repeat = 0; repeat < 3; ++repeat) {
      for (int i = 0; i < 256; ++i) bytes.push_back(static_cast<uint8_t>(i));
    }
    return bytes;
  }();
  return payload;
}

inline IOBinding Cache(const std::string& name, Direction direction) {
  return IOBinding{name, DType::kFloat32, direction, Device::kCuda, {{1, 1}, {2, 2}, {64, 64}, {16, 16}}};
}

inline Blob CallerKvBlob() {
  Blob blob;
  blob.engine_kind = EngineKind::kAoti;
  blob.device_id = 0;
  blob.aliased_outputs_elided = true;
  blob.metadata.bindings = {
      IOBinding{"tokens", DType::kInt64, Direction::kInput, Device::kCuda, {{1, 1}, {1, 64}}},
      Cache("k_cache", Direction::kInput),
      Cache("v_cache", Direction::kInput),
      IOBinding{"logits", DType::kFloat32, Direction::kOutput, Device::kCuda, {{1, 1}, {1, 64}, {32, 32}}},
      Cache("k_cache_out", Direction::kOutput),
      Cache("v_cache_out", Direction::kOutput),
  };
  blob.metadata.aliased_io = {
      AliasedIO{"k_cache_out", "k_cache", AliasKind::kKvCacheUpdate},
      AliasedIO{"v_cache_out", "v_cache", AliasKind::kKvCacheUpdate},
  };
  blob.payload = ExamplePayload().data();
  blob.payload_size = ExamplePayload().size();
  return blob;
}

}  // namespace zerokv::blob::testing
