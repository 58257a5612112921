// DeviceOps: the memory, copy, stream and event primitives of the device an engine computes on.
//
// The delegate runtime is written once against this interface; HostDeviceOps serves host engines
// (everything is synchronous, streams and events are null), CudaDeviceOps serves CUDA engines
// (cuda_device_ops.h, built where a CUDA toolkit is found). Tests inject their own to count copies
// and synchronizations.
#pragma once

#include <cstddef>
#include <memory>

#include "cc/engines/engine.h"
#include "cc/runtime/status.h"

namespace zerokv::runtime {

using engines::StreamHandle;
// A CUDA event (cudaEvent_t) as an opaque handle; nullptr on the host.
using EventHandle = void*;

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;

  virtual Status Allocate(size_t bytes, void** data) = 0;
  virtual void Free(void* data) = 0;

  // Stream-ordered memory (the runtime-owned KV caches, which grow while work is in flight): the
  // allocation is usable by work enqueued on `stream` from now on, and FreeAsync releases `data`
  // only when `stream` reaches it, i.e. after every earlier use on that stream (cudaMallocAsync /
  // cudaFreeAsync). Other streams must be ordered after `stream` (an event) before using it.
  virtual Status AllocateAsync(size_t bytes, StreamHandle stream, void** data) = 0;
  virtual Status FreeAsync(void* data, StreamHandle stream) = 0;

  // Enqueues a copy on `stream`. A host source or destination must stay valid until the stream
  // reaches the copy (host-to-device from pageable memory is safe once this returns).
  virtual Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind,
                      StreamHandle stream) = 0;
  // Enqueues a copy of `rows` rows of `row_bytes` each, `src_pitch` and `dst_pitch` bytes apart.
  virtual Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                        size_t row_bytes, size_t rows, CopyKind kind, StreamHandle stream) = 0;
  // Enqueues setting `bytes` bytes at `data` (device memory) to zero.
  virtual Status Zero(void* data, size_t bytes, StreamHandle stream) = 0;

  virtual Status CreateStream(StreamHandle* stream) = 0;
  virtual void DestroyStream(StreamHandle stream) = 0;
  virtual Status CreateEvent(EventHandle* event) = 0;
  virtual void DestroyEvent(EventHandle event) = 0;
  virtual Status RecordEvent(EventHandle event, StreamHandle stream) = 0;
  // Makes `stream` wait for `event` without blocking the host.
  virtual Status StreamWaitEvent(StreamHandle stream, EventHandle event) = 0;
  // Blocks the host until `event` (or everything on `stream`) has completed.
  virtual Status SynchronizeEvent(EventHandle event) = 0;
  virtual Status SynchronizeStream(StreamHandle stream) = 0;

  // Whether the hardware says `data` is memory this device computes on directly (cudaMalloc'd or
  // managed memory for CUDA). Host engines compute on any memory.
  virtual bool IsDeviceMemory(const void* data) const = 0;
};

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
};

// The DeviceOps for an engine's compute device: host, or CUDA where this runtime was built with a
// CUDA toolkit (a clear error otherwise).
Status MakeDeviceOps(engines::ComputeDevice device, int device_id,
                     std::unique_ptr<DeviceOps>* ops);

}  // namespace zerokv::runtime
