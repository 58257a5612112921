// PinnedPlannedMemory over the tiny example's program (its delegates tagged cuda:0, so it plans
// buffers on the host and on CUDA; here the host allocator serves DeviceType::CUDA). With a CUDA
// device every host buffer comes back page-locked and every buffer where the program plans it;
// without one (CI) Create refuses, naming the method and the buffer, and the cause.
#include "cc/runtime/device_allocators/pinned_planned_memory.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include <executorch/extension/module/module.h>
#include <executorch/runtime/platform/runtime.h>
#include <gtest/gtest.h>

namespace zerokv::runtime {
namespace {

using executorch::extension::Module;
using executorch::runtime::MethodMeta;

class PinnedPlannedMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executorch::runtime::runtime_init();
    const char* pte = std::getenv("TINY_PTE");
    ASSERT_NE(pte, nullptr) << "TINY_PTE is not set";
    module_ = std::make_unique<Module>(pte);
    auto meta = module_->method_meta("decode");
    ASSERT_TRUE(meta.ok()) << "the tiny program has no decode method";
    meta_.emplace(meta.get());
    for (size_t i = 0; i < meta_->num_memory_planned_buffers(); ++i) {
      (meta_->memory_planned_buffer_device(i)->is_cpu() ? host_buffers_ : device_buffers_)++;
    }
    // Both kinds, or the test below would not cover what it says.
    ASSERT_GT(host_buffers_, 0);
    ASSERT_GT(device_buffers_, 0);
  }

  static bool HaveCudaDevice() {
    int count = 0;
    const bool found = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();
    return found;
  }

  std::unique_ptr<Module> module_;
  std::optional<MethodMeta> meta_;
  int host_buffers_ = 0;
  int device_buffers_ = 0;
};

TEST_F(PinnedPlannedMemoryTest, PlacesEachBufferOrSaysWhyNot) {
  std::unique_ptr<PinnedPlannedMemory> memory;
  const base::Status created = PinnedPlannedMemory::Create(*meta_, "decode", &memory);
  if (!HaveCudaDevice()) {
    ASSERT_FALSE(created.ok());
    EXPECT_EQ(memory, nullptr);
    EXPECT_NE(created.message().find("method 'decode': planned buffer "), std::string::npos)
        << created.message();
    EXPECT_NE(created.message().find("cudaHostAlloc of "), std::string::npos) << created.message();
    std::printf("no CUDA device: the refusal checked, not the page-locked buffers: %s\n",
                created.message().c_str());
    return;
  }
  ASSERT_TRUE(created.ok()) << created.message();
  auto* allocator = memory->allocator();
  ASSERT_EQ(allocator->planned_buffer_devices().size(), meta_->num_memory_planned_buffers());
  for (size_t i = 0; i < meta_->num_memory_planned_buffers(); ++i) {
    const auto device = *meta_->memory_planned_buffer_device(i);
    EXPECT_EQ(allocator->planned_buffer_devices()[i].type(), device.type()) << "buffer " << i;
    auto data = allocator->get_offset_address(i, 0, *meta_->memory_planned_buffer_size(i));
    ASSERT_TRUE(data.ok()) << "buffer " << i;
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, data.get()), cudaSuccess);
    EXPECT_EQ(attributes.type == cudaMemoryTypeHost, device.is_cpu()) << "buffer " << i;
  }
}

TEST_F(PinnedPlannedMemoryTest, LoadMethodNamesAMissingMethodAndKeepsNothing) {
  std::unique_ptr<PinnedPlannedMemory> memory;
  const base::Status loaded = PinnedPlannedMemory::LoadMethod(*module_, "no_such_method", &memory);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.message().find("method 'no_such_method'"), std::string::npos) << loaded.message();
  EXPECT_EQ(memory, nullptr);
}

}  // namespace
}  // namespace zerokv::runtime
