// PinnedPlannedMemory: the memory-planned buffers of one ExecuTorch method, to pass to
// Module::load_method (or Program::load_method through a MemoryManager), with its host buffers
// page-locked.
//
// A method whose delegates run on CUDA copies its host inputs in and its host outputs out at every
// execute (ExecuTorch's et_copy ops, through the CUDA DeviceAllocator). From pageable memory the
// driver stages each copy through a buffer of its own: on an H200 the 1B decode step (its token and
// position in, 256 KiB of logits out) took 0.024 ms less over page-locked buffers, 2.5-2.8% of it
// (tools/bench/results/h200/pinned_planned_memory_ab_480370a.md).
// Module allocates its host buffers with malloc; this allocates them with cudaHostAlloc, and the
// device buffers as Module does (DeviceMemoryBuffer: the DeviceAllocator registered for their
// device type).
//
// The buffers live as long as this object, which must outlive the method loaded over them. A
// buffer that cannot be allocated fails Create with what and why, and frees what it had allocated.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/runtime/core/device_memory_buffer.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/core/portable_type/device.h>
#include <executorch/runtime/core/span.h>
#include <executorch/runtime/executor/method_meta.h>

#include "cc/base/status.h"

namespace zerokv::runtime {

class PinnedPlannedMemory {
 public:
  // The buffers `meta` plans, for the method named `method` (named in errors only).
  static base::Status Create(const executorch::runtime::MethodMeta& meta, const std::string& method,
                             std::unique_ptr<PinnedPlannedMemory>* memory);
  // Loads `method` of `module` over buffers made by Create, which `memory` then keeps: declared
  // before `module`, it outlives the method. On failure `memory` is left as it was.
  static base::Status LoadMethod(executorch::extension::Module& module, const std::string& method,
                                 std::unique_ptr<PinnedPlannedMemory>* memory);
  PinnedPlannedMemory(const PinnedPlannedMemory&) = delete;
  PinnedPlannedMemory& operator=(const PinnedPlannedMemory&) = delete;

  executorch::runtime::HierarchicalAllocator* allocator() { return allocator_.get(); }

 private:
  struct FreeHost {
    void operator()(void* data) const;
  };

  PinnedPlannedMemory() = default;

  std::vector<std::unique_ptr<void, FreeHost>> host_buffers_;
  std::vector<executorch::runtime::DeviceMemoryBuffer> device_buffers_;
  std::vector<executorch::runtime::Span<uint8_t>> spans_;
  std::vector<executorch::runtime::etensor::Device> devices_;
  std::unique_ptr<executorch::runtime::HierarchicalAllocator> allocator_;
};

}  // namespace zerokv::runtime
