#include "cc/runtime/device_allocators/copy_counters.h"

#include <atomic>

namespace zerokv::runtime {
namespace {
std::atomic<uint64_t> host_to_device{0};
std::atomic<uint64_t> device_to_host{0};
}  // namespace

void CountHostToDevice(size_t bytes) { host_to_device.fetch_add(bytes, std::memory_order_relaxed); }
void CountDeviceToHost(size_t bytes) { device_to_host.fetch_add(bytes, std::memory_order_relaxed); }

}  // namespace zerokv::runtime

extern "C" uint64_t zerokv_host_to_device_bytes(void) {
  return zerokv::runtime::host_to_device.load(std::memory_order_relaxed);
}
extern "C" uint64_t zerokv_device_to_host_bytes(void) {
  return zerokv::runtime::device_to_host.load(std::memory_order_relaxed);
}
