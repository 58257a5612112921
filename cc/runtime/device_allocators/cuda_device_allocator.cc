// The DeviceAllocator for DeviceType::CUDA over the CUDA runtime, registered at static
// initialisation: ExecuTorch plans the buffers of cuda:0 delegates in cudaMalloc'd memory and
// copies method inputs in and outputs out through it. Copies are counted (copy_counters.h).
//
// Ordering. zerokv delegates enqueue on the caller's stream (a CallerStreamGuard; nullptr is the
// legacy default stream) and return with the work in flight, or, without a guard, on a stream of
// their own that they finish before returning. So the copies go on the caller's stream when one is
// selected, else on the legacy default stream:
//   - an input copy is ordered before the kernels that read it: on the caller's stream by the
//     stream itself; without one it completes before it returns (the delegate's own stream is
//     non-blocking and does not wait for the legacy stream). From page-locked memory
//     (PinnedPlannedMemory) a copy on the caller's stream completes before it returns too: the
//     driver reads such a source when the stream reaches the copy, not before the call returns as
//     it does a pageable one, and the next execute writes the same host buffer;
//   - an output copy is ordered after the kernels that wrote it (on the caller's stream, or by the
//     delegate having finished its own), and completes before it returns: the host reads it next.
// Nothing here waits for the whole device: results must not depend on this allocator (another
// DeviceAllocator, a device-resident method output, another backend reading ours).
#include <cuda_runtime_api.h>

#include <optional>

#include <executorch/runtime/core/device_allocator.h>
#include <executorch/runtime/platform/log.h>

#include "cc/runtime/caller_stream.h"
#include "cc/runtime/cuda_pointers.h"
#include "cc/runtime/device_allocators/copy_counters.h"

namespace zerokv::runtime {
namespace {

using executorch::runtime::Error;
using executorch::runtime::Result;
using executorch::runtime::etensor::DeviceIndex;
using executorch::runtime::etensor::DeviceType;
using base::StreamHandle;

Error Failed(cudaError_t error, const char* what, size_t nbytes) {
  ET_LOG(Error, "zerokv CUDA allocator: %s of %zu bytes failed: %s", what, nbytes, cudaGetErrorString(error));
  return Error::Internal;
}

class CudaDeviceAllocator final : public executorch::runtime::DeviceAllocator {
 public:
  Result<void*> allocate(size_t nbytes, DeviceIndex index, size_t alignment) override {
    void* data = nullptr;
    cudaError_t error = cudaSetDevice(index);
    if (error == cudaSuccess) error = cudaMalloc(&data, nbytes);
    if (error != cudaSuccess) {
      Failed(error, "cudaMalloc", nbytes);
      return Error::MemoryAllocationFailed;
    }
    if (reinterpret_cast<uintptr_t>(data) % alignment != 0) {  // cudaMalloc aligns to 256 bytes
      ET_LOG(Error, "zerokv CUDA allocator: cudaMalloc result not aligned to %zu bytes", alignment);
      cudaFree(data);
      return Error::MemoryAllocationFailed;
    }
    // Planned memory starts zeroed (once, at method load): ExecuTorch leaves mutable buffers
    // uninitialised, and a caller-owned cache's unwritten positions reach masked attention, where a
    // NaN would survive the zero weight.
    error = cudaMemset(data, 0, nbytes);
    if (error != cudaSuccess) {
      Failed(error, "cudaMemset", nbytes);
      cudaFree(data);
      return Error::MemoryAllocationFailed;
    }
    return data;
  }
  void deallocate(void* data, DeviceIndex index) override {
    cudaSetDevice(index);
    cudaFree(data);  // synchronizes the device: no delegate work can still use it
  }
  Error copy_host_to_device(void* dst, const void* src, size_t nbytes, DeviceIndex index) override {
    cudaError_t error = cudaSetDevice(index);
    const std::optional<StreamHandle> caller_stream = CurrentCallerStream();
    auto stream = static_cast<cudaStream_t>(caller_stream.value_or(nullptr));
    if (error == cudaSuccess) error = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream);
    if (error == cudaSuccess && (!caller_stream || IsPageLockedHostMemory(src))) error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) return Failed(error, "host-to-device copy", nbytes);
    CountHostToDevice(nbytes);
    return Error::Ok;
  }
  Error copy_device_to_host(void* dst, const void* src, size_t nbytes, DeviceIndex index) override {
    cudaError_t error = cudaSetDevice(index);
    auto stream = static_cast<cudaStream_t>(CurrentCallerStream().value_or(nullptr));
    if (error == cudaSuccess) error = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream);
    if (error == cudaSuccess) error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) return Failed(error, "device-to-host copy", nbytes);
    CountDeviceToHost(nbytes);
    return Error::Ok;
  }
  DeviceType device_type() const override { return DeviceType::CUDA; }
};

CudaDeviceAllocator allocator;
const bool registered = [] {
  executorch::runtime::register_device_allocator(&allocator);
  return true;
}();

}  // namespace
}  // namespace zerokv::runtime
