// Bytes ExecuTorch copied between host and device memory through the registered DeviceAllocator
// (the zerokv one of the shared library: host_device_allocator or cuda_device_allocator): how a
// runner measures what a decode step moves. Exported with C linkage for runners and ctypes:
//
//   lib = ctypes.CDLL("libzerokv_backend_cuda.so", mode=ctypes.RTLD_GLOBAL)
//   lib.zerokv_host_to_device_bytes.restype = ctypes.c_uint64
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
namespace zerokv::runtime {
void CountHostToDevice(size_t bytes);
void CountDeviceToHost(size_t bytes);
}  // namespace zerokv::runtime

extern "C" {
#endif

uint64_t zerokv_host_to_device_bytes(void);
uint64_t zerokv_device_to_host_bytes(void);

#ifdef __cplusplus
}
#endif
