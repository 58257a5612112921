// A host-memory DeviceAllocator registered for DeviceType::CUDA (test-only; see the .cc), and what
// it records.
#pragma once

#include <cstddef>

namespace zerokv::runtime::testing {

// Whether `data` lies in memory this allocator handed out (device-planned memory).
bool InDevicePlannedMemory(const void* data);
// Bytes ExecuTorch copied host-to-device / device-to-host through this allocator.
size_t HostToDeviceBytes();
size_t DeviceToHostBytes();
// The address `binding` was bound to by the last zerokv Execute (a binding trace), or nullptr.
const void* BoundAddress(const char* binding);

}  // namespace zerokv::runtime::testing
