// How the GPU checks (gpu_check_test in gpu_check.bzl) report: CHECK counts a failure and carries
// on, so that one run on the scarce GPU machine reports every failure; main returns non-zero when
// `failures` is. CUDA_OK is CHECK for a CUDA call. (The runtime itself turns CUDA errors into a
// Status instead: cuda_device_ops.cc.)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>

inline int failures = 0;

#define CHECK(condition, ...)                          \
  do {                                                 \
    if (!(condition)) {                                \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                        \
      std::printf("\n");                               \
      ++failures;                                      \
    }                                                  \
  } while (0)

#define CUDA_OK(call)                                                                         \
  do {                                                                                        \
    cudaError_t zerokv_cuda_error_ = (call);                                                  \
    CHECK(zerokv_cuda_error_ == cudaSuccess, "%s: %s", #call,                                 \
          cudaGetErrorString(zerokv_cuda_error_));                                            \
  } while (0)
