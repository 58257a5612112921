#include "cc/runtime/device_allocators/pinned_planned_memory.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

namespace zerokv::runtime {

using executorch::runtime::DeviceMemoryBuffer;
using executorch::runtime::HierarchicalAllocator;
using executorch::runtime::Span;
using executorch::runtime::etensor::Device;

void PinnedPlannedMemory::FreeHost::operator()(void* data) const { cudaFreeHost(data); }

base::Status PinnedPlannedMemory::Create(const executorch::runtime::MethodMeta& meta,
                                         const std::string& method,
                                         std::unique_ptr<PinnedPlannedMemory>* memory) {
  std::unique_ptr<PinnedPlannedMemory> planned(new PinnedPlannedMemory());
  const size_t count = meta.num_memory_planned_buffers();
  for (size_t i = 0; i < count; ++i) {
    const std::string what = "method '" + method + "': planned buffer " + std::to_string(i);
    auto size = meta.memory_planned_buffer_size(i);
    auto device = meta.memory_planned_buffer_device(i);
    if (!size.ok() || !device.ok()) {
      return base::InvalidProgram(what + ": the program gives no size or device for it");
    }
    const auto bytes = static_cast<size_t>(size.get());
    void* data = nullptr;  // a zero-byte buffer holds nothing: nothing to allocate
    if (bytes != 0 && device->is_cpu()) {
      const cudaError_t error = cudaHostAlloc(&data, bytes, cudaHostAllocDefault);
      if (error != cudaSuccess) {
        cudaGetLastError();
        return base::Internal(what + ": cudaHostAlloc of " + std::to_string(bytes) +
                              " bytes failed: " + cudaGetErrorString(error));
      }
      planned->host_buffers_.emplace_back(data);
      std::memset(data, 0, bytes);  // as Module's host buffers start
    } else if (bytes != 0) {
      auto buffer = DeviceMemoryBuffer::create(bytes, device->type(), device->index());
      if (!buffer.ok()) {
        return base::Status(buffer.error(),
                            what + ": no DeviceAllocator gave " + std::to_string(bytes) +
                                " bytes on device type " +
                                std::to_string(static_cast<int>(device->type())) + ", index " +
                                std::to_string(device->index()) + " (is one registered for it?)");
      }
      data = buffer->data();
      planned->device_buffers_.push_back(std::move(buffer.get()));
    }
    planned->spans_.emplace_back(static_cast<uint8_t*>(data), bytes);
    planned->devices_.push_back(device.get());
  }
  planned->allocator_ = std::make_unique<HierarchicalAllocator>(
      Span<Span<uint8_t>>(planned->spans_.data(), planned->spans_.size()),
      Span<const Device>(planned->devices_.data(), planned->devices_.size()));
  *memory = std::move(planned);
  return base::Status::Ok();
}

base::Status PinnedPlannedMemory::LoadMethod(executorch::extension::Module& module,
                                             const std::string& method,
                                             std::unique_ptr<PinnedPlannedMemory>* memory) {
  auto meta = module.method_meta(method);
  if (!meta.ok()) {
    return base::Status(meta.error(), "method '" + method + "': the program gives no meta for it");
  }
  std::unique_ptr<PinnedPlannedMemory> planned;
  ZEROKV_RETURN_IF_ERROR(Create(meta.get(), method, &planned));
  const executorch::runtime::Error loaded = module.load_method(method, planned->allocator());
  if (loaded != executorch::runtime::Error::Ok) {
    return base::Status(loaded, "method '" + method + "': it did not load over page-locked buffers");
  }
  *memory = std::move(planned);
  return base::Status::Ok();
}

}  // namespace zerokv::runtime
