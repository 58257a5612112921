// The checks the TensorRT adapter makes before it enqueues, as pure functions (no TensorRT), so
// that they are tested where no TensorRT SDK is:
//
//   int profile = 0;
//   ZEROKV_RETURN_IF_ERROR(SelectProfile(profiles, {{"input_ids", {1, 7}}}, current, &profile));
//   ZEROKV_RETURN_IF_ERROR(CheckAddressAlignment("k_cache", pointer));
//   ZEROKV_RETURN_IF_ERROR(CheckOutputFits("logits", {1, 7, 64}, sizeof(float), capacity));
//
// Each refusal names the binding at fault and says why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cc/base/status.h"

namespace zerokv::engines::tensorrt {

using base::Status;

// TensorRT reads and writes an I/O tensor only at an address aligned to 256 bytes
// (IExecutionContext::setTensorAddress).
inline constexpr size_t kTensorAddressAlignment = 256;

// The shapes one input admits in one optimization profile, extent by extent.
struct ShapeRange {
  std::vector<int64_t> min;
  std::vector<int64_t> max;
};

// One optimization profile: input name -> the shapes it admits. Every input of the engine is in
// every profile (a static input with min == max).
using ProfileRanges = std::map<std::string, ShapeRange>;

// The profile that admits every shape of `shapes` (input name -> shape of the next run): `current`
// if it does, which spares a profile switch, else the lowest index that does. `shapes` must give
// every input of the profiles and nothing else. Refused, naming the input: an input without a
// shape or unknown to the engine, and shapes no one profile admits (with each profile's range).
Status SelectProfile(const std::vector<ProfileRanges>& profiles,
                     const std::map<std::string, std::vector<int64_t>>& shapes, int current,
                     int* selected);

// Refuses an address that is not aligned to kTensorAddressAlignment, naming binding `name`.
Status CheckAddressAlignment(const std::string& name, const void* address);

// Refuses output `name` when the bytes of `shape` exceed `capacity`, the buffer bound to it, or
// when an extent is unknown before the run (negative: a data-dependent shape, which TensorRT would
// need an output allocator for).
Status CheckOutputFits(const std::string& name, const std::vector<int64_t>& shape,
                       size_t element_size, size_t capacity);

}  // namespace zerokv::engines::tensorrt
