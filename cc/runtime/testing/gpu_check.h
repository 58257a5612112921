// How the GPU checks (gpu_check_test in gpu_check.bzl) report: CHECK counts a failure and carries
// on, so that one run on the scarce GPU machine reports every failure; main returns non-zero when
// `failures` is.
#pragma once

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
