// What the CUDA driver says a pointer is (cudaPointerGetAttributes), for the runtime's CUDA
// DeviceOps and the CUDA DeviceAllocator. A pointer the driver does not know is neither.
#pragma once

namespace zerokv::runtime {

// Memory a CUDA kernel reads directly: cudaMalloc'd or managed.
bool IsCudaDeviceMemory(const void* data);

// Host memory the device reads directly (cudaHostAlloc'd or registered). A copy from it reads it
// when its stream reaches the copy, not before cudaMemcpyAsync returns as it does pageable memory.
bool IsPageLockedHostMemory(const void* data);

}  // namespace zerokv::runtime
