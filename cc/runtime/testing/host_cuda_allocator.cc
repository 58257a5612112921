// A DeviceAllocator for DeviceType::CUDA that hands out host memory, registered at static
// initialisation. With it, a CPU machine can load and run programs whose delegates are tagged
// target_device=cuda:0: ExecuTorch plans their buffers in "CUDA" memory (TensorImpl device CUDA),
// which is what the zerokv runtime checks for residency, and a host engine can read it.
//
// Test-only: it records what it allocated and copied, exposed with C linkage for ctypes tests
// (zerokv_testing_*), so that a test can prove a buffer lives in device-planned memory and that
// no cache-sized copy happened.
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <executorch/runtime/core/device_allocator.h>

#include "cc/runtime/binding_trace.h"
#include "cc/runtime/testing/host_cuda_allocator.h"

namespace zerokv::runtime::testing {
namespace {

using executorch::runtime::Error;
using executorch::runtime::Result;
using executorch::runtime::etensor::DeviceIndex;
using executorch::runtime::etensor::DeviceType;

struct Allocation {
  const void* data;
  size_t bytes;
};

struct Ledger {
  std::mutex mutex;
  std::vector<Allocation> live;
  size_t host_to_device_bytes = 0;
  size_t device_to_host_bytes = 0;
  std::map<std::string, const void*> bound;  // binding -> address at the last Execute
};

Ledger& TheLedger() {
  static auto* ledger = new Ledger();
  return *ledger;
}

class HostCudaAllocator final : public executorch::runtime::DeviceAllocator {
 public:
  Result<void*> allocate(size_t nbytes, DeviceIndex, size_t alignment) override {
    if (alignment < 64) alignment = 64;
    const size_t rounded = (nbytes + alignment - 1) / alignment * alignment;
    void* data = std::aligned_alloc(alignment, rounded);
    if (data == nullptr) return Error::MemoryAllocationFailed;
    // Zeroed, like zerokv's device allocators (cc/runtime/device_allocators/cuda_device_allocator.cc).
    std::memset(data, 0, rounded);
    std::lock_guard<std::mutex> lock(TheLedger().mutex);
    TheLedger().live.push_back({data, nbytes});
    return data;
  }
  void deallocate(void* data, DeviceIndex) override {
    {
      std::lock_guard<std::mutex> lock(TheLedger().mutex);
      auto& live = TheLedger().live;
      for (auto it = live.begin(); it != live.end(); ++it) {
        if (it->data == data) {
          live.erase(it);
          break;
        }
      }
    }
    std::free(data);
  }
  Error copy_host_to_device(void* dst, const void* src, size_t nbytes, DeviceIndex) override {
    std::memcpy(dst, src, nbytes);
    std::lock_guard<std::mutex> lock(TheLedger().mutex);
    TheLedger().host_to_device_bytes += nbytes;
    return Error::Ok;
  }
  Error copy_device_to_host(void* dst, const void* src, size_t nbytes, DeviceIndex) override {
    std::memcpy(dst, src, nbytes);
    std::lock_guard<std::mutex> lock(TheLedger().mutex);
    TheLedger().device_to_host_bytes += nbytes;
    return Error::Ok;
  }
  DeviceType device_type() const override { return DeviceType::CUDA; }
};

void RecordBinding(const char* binding, const void* address) {
  std::lock_guard<std::mutex> lock(TheLedger().mutex);
  TheLedger().bound[binding] = address;
}

HostCudaAllocator allocator;
const bool registered = [] {
  executorch::runtime::register_device_allocator(&allocator);
  SetBindingTrace(RecordBinding);
  return true;
}();

}  // namespace

bool InDevicePlannedMemory(const void* data) {
  std::lock_guard<std::mutex> lock(TheLedger().mutex);
  for (const Allocation& allocation : TheLedger().live) {
    const char* begin = static_cast<const char*>(allocation.data);
    if (data >= begin && data < begin + allocation.bytes) return true;
  }
  return false;
}

size_t HostToDeviceBytes() {
  std::lock_guard<std::mutex> lock(TheLedger().mutex);
  return TheLedger().host_to_device_bytes;
}

size_t DeviceToHostBytes() {
  std::lock_guard<std::mutex> lock(TheLedger().mutex);
  return TheLedger().device_to_host_bytes;
}

const void* BoundAddress(const char* binding) {
  std::lock_guard<std::mutex> lock(TheLedger().mutex);
  auto found = TheLedger().bound.find(binding);
  return found == TheLedger().bound.end() ? nullptr : found->second;
}

}  // namespace zerokv::runtime::testing

extern "C" {
// The address binding `binding` of the last executed zerokv delegate was bound to, or null.
const void* zerokv_testing_bound_address(const char* binding) {
  return zerokv::runtime::testing::BoundAddress(binding);
}
int zerokv_testing_in_device_planned_memory(const void* data) {
  return zerokv::runtime::testing::InDevicePlannedMemory(data) ? 1 : 0;
}
size_t zerokv_testing_host_to_device_bytes() {
  return zerokv::runtime::testing::HostToDeviceBytes();
}
size_t zerokv_testing_device_to_host_bytes() {
  return zerokv::runtime::testing::DeviceToHostBytes();
}
}
