// The runtime's DeviceOps (the interface: cc/base/device_ops.h): HostDeviceOps serves host engines
// (everything is synchronous, streams and events are null), CudaDeviceOps serves CUDA engines
// (cuda_device_ops.cc, built where a CUDA toolkit is found).
#pragma once

#include <memory>

#include "cc/base/device_ops.h"
#include "cc/base/status.h"

namespace zerokv::runtime {

// The runtime is written against base's DeviceOps throughout; it names its types unqualified.
using base::CopyKind;
using base::DeviceOps;
using base::EventHandle;
using base::Status;
using base::StreamHandle;

// Host engines: plain memory, memcpy, no streams or events.
class HostDeviceOps final : public DeviceOps {
 public:
  Status Allocate(size_t bytes, void** data) override;
  void Free(void* data) override;
  Status AllocateAsync(size_t bytes, StreamHandle, void** data) override {
    return Allocate(bytes, data);
  }
  Status FreeAsync(void* data, StreamHandle) override {
    Free(data);
    return Status::Ok();
  }
  Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind,
              StreamHandle stream) override;
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                size_t rows, CopyKind kind, StreamHandle stream) override;
  Status Zero(void* data, size_t bytes, StreamHandle stream) override;
  Status CreateStream(StreamHandle* stream) override;
  void DestroyStream(StreamHandle) override {}
  Status CreateEvent(EventHandle* event) override;
  void DestroyEvent(EventHandle) override {}
  Status RecordEvent(EventHandle, StreamHandle) override { return Status::Ok(); }
  Status StreamWaitEvent(StreamHandle, EventHandle) override { return Status::Ok(); }
  Status SynchronizeEvent(EventHandle) override { return Status::Ok(); }
  Status SynchronizeStream(StreamHandle) override { return Status::Ok(); }
  bool IsDeviceMemory(const void*) const override { return true; }
  bool IsPageLocked(const void*) const override { return false; }
};

// The DeviceOps for an engine's compute device: host, or CUDA where this runtime was built with a
// CUDA toolkit (a clear error otherwise).
Status MakeDeviceOps(base::ComputeDevice device, int device_id,
                     std::unique_ptr<DeviceOps>* ops);

}  // namespace zerokv::runtime
