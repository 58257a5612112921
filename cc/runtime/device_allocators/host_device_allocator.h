// The host-memory DeviceAllocator for DeviceType::CUDA (host_device_allocator.cc): what a runner or
// a test can ask it, with C linkage for ctypes.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// 1 when `data` lies in memory this allocator handed out (ExecuTorch's device-planned memory).
int zerokv_in_host_device_planned_memory(const void* data);

#ifdef __cplusplus
}
#endif
