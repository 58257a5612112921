// A DeviceAllocator for DeviceType::CUDA that hands out host memory, registered at static
// initialisation: with it, a machine without a GPU runs programs whose zerokv delegates are tagged
// cuda:0 and compiled for the CPU (engine_options={"compile_device": "cpu"}). ExecuTorch still
// plans their buffers as CUDA memory, which is what the zerokv runtime checks for residency, and a
// host engine reads it directly. Copies are counted (copy_counters.h), and the allocations are
// remembered so that a test can tell device-planned memory from the rest (host_device_allocator.h).
#include "cc/runtime/device_allocators/host_device_allocator.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include <executorch/runtime/core/device_allocator.h>

#include "cc/runtime/device_allocators/copy_counters.h"

namespace zerokv::runtime {
namespace {

using executorch::runtime::Error;
using executorch::runtime::Result;
using executorch::runtime::etensor::DeviceIndex;
using executorch::runtime::etensor::DeviceType;

struct Allocations {
  std::mutex mutex;
  std::vector<std::pair<const char*, size_t>> live;  // start, bytes
};

Allocations& Live() {
  static auto* allocations = new Allocations();  // never destroyed: used until the process exits
  return *allocations;
}

class HostDeviceAllocator final : public executorch::runtime::DeviceAllocator {
 public:
  Result<void*> allocate(size_t nbytes, DeviceIndex, size_t alignment) override {
    if (alignment < 64) alignment = 64;
    const size_t rounded = (nbytes + alignment - 1) / alignment * alignment;
    void* data = std::aligned_alloc(alignment, rounded);
    if (data == nullptr) return Error::MemoryAllocationFailed;
    std::memset(data, 0, rounded);  // zeroed like the CUDA allocator's planned memory (see there)
    std::lock_guard<std::mutex> lock(Live().mutex);
    Live().live.emplace_back(static_cast<const char*>(data), nbytes);
    return data;
  }
  void deallocate(void* data, DeviceIndex) override {
    {
      std::lock_guard<std::mutex> lock(Live().mutex);
      auto& live = Live().live;
      for (auto it = live.begin(); it != live.end(); ++it) {
        if (it->first == data) {
          live.erase(it);
          break;
        }
      }
    }
    std::free(data);
  }
  Error copy_host_to_device(void* dst, const void* src, size_t nbytes, DeviceIndex) override {
    std::memcpy(dst, src, nbytes);
    CountHostToDevice(nbytes);
    return Error::Ok;
  }
  Error copy_device_to_host(void* dst, const void* src, size_t nbytes, DeviceIndex) override {
    std::memcpy(dst, src, nbytes);
    CountDeviceToHost(nbytes);
    return Error::Ok;
  }
  DeviceType device_type() const override { return DeviceType::CUDA; }
};

HostDeviceAllocator allocator;
const bool registered = [] {
  executorch::runtime::register_device_allocator(&allocator);
  return true;
}();

}  // namespace
}  // namespace zerokv::runtime

extern "C" int zerokv_in_host_device_planned_memory(const void* data) {
  auto* byte = static_cast<const char*>(data);
  std::lock_guard<std::mutex> lock(zerokv::runtime::Live().mutex);
  for (const auto& [start, bytes] : zerokv::runtime::Live().live) {
    if (byte >= start && byte < start + bytes) return 1;
  }
  return 0;
}
