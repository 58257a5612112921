// DeviceOps: the memory, copy, stream and event primitives of the device an engine computes on,
// and the names they share with engines (StreamHandle, ComputeDevice).
//
// The bottom of the C++ packages: engines, kvcache and runtime are all written against this
// interface, so none of them needs another's headers for it. The runtime makes the implementations
// (cc/runtime/device_ops.h: host, and CUDA where a CUDA toolkit is found); tests inject their own
// (cc/base/testing) to count copies and synchronizations.
#pragma once

#include <cstddef>

#include "cc/base/status.h"

namespace zerokv::base {

// A CUDA stream (cudaStream_t) as an opaque handle, so that code without CUDA can name it.
// nullptr on a host engine.
using StreamHandle = void*;
// A CUDA event (cudaEvent_t) as an opaque handle; nullptr on the host.
using EventHandle = void*;

// Where an engine computes, which decides how the runtime stages, copies and synchronizes.
enum class ComputeDevice { kHost, kCuda };

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
  // reaches the copy (host-to-device from pageable memory is safe once this returns; from
  // page-locked memory it is read only when the stream reaches the copy).
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
  // Whether `data` is host memory the device reads directly (page-locked: cudaHostAlloc'd or
  // registered), which a copy reads only when its stream reaches it. Never on a host engine.
  virtual bool IsPageLocked(const void* data) const = 0;
};

}  // namespace zerokv::base
