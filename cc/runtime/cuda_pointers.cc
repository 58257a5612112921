#include "cc/runtime/cuda_pointers.h"

#include <cuda_runtime_api.h>

namespace zerokv::runtime {
namespace {

cudaMemoryType TypeOf(const void* data) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    cudaGetLastError();  // A host pointer may leave a sticky "invalid value" on old drivers.
    return cudaMemoryTypeUnregistered;
  }
  return attributes.type;
}

}  // namespace

bool IsCudaDeviceMemory(const void* data) {
  const cudaMemoryType type = TypeOf(data);
  return type == cudaMemoryTypeDevice || type == cudaMemoryTypeManaged;
}

bool IsPageLockedHostMemory(const void* data) { return TypeOf(data) == cudaMemoryTypeHost; }

}  // namespace zerokv::runtime
