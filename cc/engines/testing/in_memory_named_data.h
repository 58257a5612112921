// Named data as a map of key -> bytes the test owns, for engine and runtime tests: entries set by
// hand, or copied from a real NamedDataMap (a .ptd the test then edits).
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <executorch/runtime/core/named_data_map.h>

namespace zerokv::engines::testing {

class InMemoryNamedData final : public executorch::runtime::NamedDataMap {
 public:
  InMemoryNamedData() = default;

  // Every entry of `real`, copied.
  explicit InMemoryNamedData(const executorch::runtime::NamedDataMap& real) {
    for (uint32_t i = 0; i < real.get_num_keys().get(); ++i) {
      const char* key = real.get_key(i).get();
      auto data = real.get_data(key);
      const auto* bytes = static_cast<const uint8_t*>(data->data());
      entries[key] = std::vector<uint8_t>(bytes, bytes + data->size());
    }
  }

  executorch::runtime::Result<const executorch::runtime::TensorLayout> get_tensor_layout(
      std::string_view) const override {
    return executorch::runtime::Error::NotFound;
  }
  executorch::runtime::Result<executorch::runtime::FreeableBuffer> get_data(std::string_view key) const override {
    auto found = entries.find(std::string(key));
    if (found == entries.end()) return executorch::runtime::Error::NotFound;
    return executorch::runtime::FreeableBuffer(found->second.data(), found->second.size(), nullptr);
  }
  executorch::runtime::Error load_data_into(std::string_view, void*, size_t) const override {
    return executorch::runtime::Error::NotSupported;
  }
  executorch::runtime::Result<uint32_t> get_num_keys() const override {
    return static_cast<uint32_t>(entries.size());
  }
  executorch::runtime::Result<const char*> get_key(uint32_t index) const override {
    auto it = entries.begin();
    std::advance(it, index);
    return it->first.c_str();
  }

  std::map<std::string, std::vector<uint8_t>> entries;
};

}  // namespace zerokv::engines::testing
