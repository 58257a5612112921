// The CUDA DeviceAllocator's input copy on a caller's stream that is still busy: once
// copy_host_to_device returns, ExecuTorch may write the host buffer again (the next execute's
// set_input), so the bytes that reach the device must be the ones it had at the call, from pageable
// and from page-locked memory (PinnedPlannedMemory's), whose copy the driver reads only when the
// stream reaches it.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include <executorch/runtime/core/device_allocator.h>
#include <gtest/gtest.h>

#include "cc/runtime/caller_stream.h"

namespace zerokv::runtime {
namespace {

using executorch::runtime::DeviceAllocator;
using executorch::runtime::etensor::DeviceType;

// Holds the stream for a while, so that a copy enqueued after it runs well after the call.
void CUDART_CB Sleep(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }

class CudaDeviceAllocatorGpuTest : public ::testing::TestWithParam<bool> {};

TEST_P(CudaDeviceAllocatorGpuTest, InputCopyOnABusyCallerStreamKeepsTheBytesOfTheCall) {
  const bool page_locked = GetParam();
  DeviceAllocator* allocator = executorch::runtime::get_device_allocator(DeviceType::CUDA);
  ASSERT_NE(allocator, nullptr) << "the CUDA allocator is not registered";
  int64_t* host = nullptr;
  int64_t pageable = 0;
  if (page_locked) {
    ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&host), sizeof(int64_t)), cudaSuccess);
  } else {
    host = &pageable;
  }
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, sizeof(int64_t)), cudaSuccess);
  ASSERT_EQ(cudaMemset(device, 0, sizeof(int64_t)), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    CallerStreamGuard guard(stream);
    ASSERT_EQ(cudaLaunchHostFunc(stream, Sleep, nullptr), cudaSuccess);
    *host = 7;
    ASSERT_EQ(allocator->copy_host_to_device(device, host, sizeof(int64_t), 0), executorch::runtime::Error::Ok);
    *host = 9;  // what the next execute would do to its input buffer
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  int64_t landed = 0;
  ASSERT_EQ(cudaMemcpy(&landed, device, sizeof(int64_t), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(landed, 7) << (page_locked ? "page-locked" : "pageable") << " source";
  cudaStreamDestroy(stream);
  cudaFree(device);
  if (page_locked) cudaFreeHost(host);
}

INSTANTIATE_TEST_SUITE_P(Sources, CudaDeviceAllocatorGpuTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& source) {
                           return source.param ? "PageLocked" : "Pageable";
                         });

}  // namespace
}  // namespace zerokv::runtime
