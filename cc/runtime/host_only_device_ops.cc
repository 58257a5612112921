// MakeDeviceOps for a runtime built without a CUDA toolkit: host engines only.
#include "cc/runtime/device_ops.h"

namespace zerokv::runtime {
using base::NotSupported;

Status MakeDeviceOps(base::ComputeDevice device, int, std::unique_ptr<DeviceOps>* ops) {
  if (device != base::ComputeDevice::kHost) {
    return NotSupported(
        "the engine computes on CUDA, but this runtime was built without a CUDA toolkit");
  }
  *ops = std::make_unique<HostDeviceOps>();
  return Status::Ok();
}

}  // namespace zerokv::runtime
