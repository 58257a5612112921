#include <cstdlib>
#include <cstring>

#include "cc/runtime/device_ops.h"

namespace zerokv::runtime {

Status HostDeviceOps::Allocate(size_t bytes, void** data) {
  // 256 bytes, like cudaMalloc, so that an engine sees the same alignment on both devices.
  constexpr size_t kAlignment = 256;
  *data = std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  if (*data == nullptr) {
    return Status(executorch::runtime::Error::MemoryAllocationFailed,
                  "host allocation of " + std::to_string(bytes) + " bytes failed");
  }
  return Status::Ok();
}

void HostDeviceOps::Free(void* data) { std::free(data); }

Status HostDeviceOps::Copy(void* dst, const void* src, size_t bytes, CopyKind, StreamHandle) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostDeviceOps::Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                             size_t row_bytes, size_t rows, CopyKind, StreamHandle) {
  for (size_t row = 0; row < rows; ++row) {
    std::memcpy(static_cast<char*>(dst) + row * dst_pitch,
                static_cast<const char*>(src) + row * src_pitch, row_bytes);
  }
  return Status::Ok();
}

Status HostDeviceOps::Zero(void* data, size_t bytes, StreamHandle) {
  if (bytes != 0) std::memset(data, 0, bytes);
  return Status::Ok();
}

Status HostDeviceOps::CreateStream(StreamHandle* stream) {
  *stream = nullptr;
  return Status::Ok();
}

Status HostDeviceOps::CreateEvent(EventHandle* event) {
  *event = nullptr;
  return Status::Ok();
}

}  // namespace zerokv::runtime
