#include "cc/engines/tensorrt/binding_checks.h"

#include <cstdint>
#include <limits>
#include <sstream>

namespace zerokv::engines::tensorrt {
namespace {

using base::InvalidArgument;

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

bool Admits(const ShapeRange& range, const std::vector<int64_t>& shape) {
  if (range.min.size() != shape.size() || range.max.size() != shape.size()) return false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < range.min[i] || shape[i] > range.max[i]) return false;
  }
  return true;
}

// Why `profile` does not admit `shapes` (naming the first input it refuses), or "" when it does.
std::string Refusal(const ProfileRanges& profile,
                    const std::map<std::string, std::vector<int64_t>>& shapes) {
  for (const auto& [name, shape] : shapes) {
    auto range = profile.find(name);
    if (range == profile.end()) return "has no range for input '" + name + "'";
    if (!Admits(range->second, shape)) {
      return "admits input '" + name + "' in " + ShapeString(range->second.min) + ".." +
             ShapeString(range->second.max) + ", not " + ShapeString(shape);
    }
  }
  return "";
}

}  // namespace

Status SelectProfile(const std::vector<ProfileRanges>& profiles,
                     const std::map<std::string, std::vector<int64_t>>& shapes, int current,
                     int* selected) {
  if (profiles.empty()) return InvalidArgument("the TensorRT engine has no optimization profile");
  for (const auto& [name, range] : profiles.front()) {
    if (shapes.count(name) == 0) {
      return InvalidArgument("input '" + name + "' has no shape for this run");
    }
  }
  for (const auto& [name, shape] : shapes) {
    if (profiles.front().count(name) == 0) {
      return InvalidArgument("'" + name + "' is not an input of the TensorRT engine");
    }
  }
  const int count = static_cast<int>(profiles.size());
  if (current >= 0 && current < count && Refusal(profiles[current], shapes).empty()) {
    *selected = current;
    return Status::Ok();
  }
  std::string refusals;
  for (int index = 0; index < count; ++index) {
    const std::string refusal = Refusal(profiles[index], shapes);
    if (refusal.empty()) {
      *selected = index;
      return Status::Ok();
    }
    refusals += (index ? "; profile " : "profile ") + std::to_string(index) + " " + refusal;
  }
  return InvalidArgument(
      "no optimization profile of the TensorRT engine admits these input shapes: " + refusals);
}

Status CheckAddressAlignment(const std::string& name, const void* address) {
  const uintptr_t offset = reinterpret_cast<uintptr_t>(address) % kTensorAddressAlignment;
  if (offset == 0) return Status::Ok();
  std::ostringstream message;
  message << "binding '" << name << "' is at " << address << ", " << offset << " bytes past a "
          << kTensorAddressAlignment
          << "-byte boundary; TensorRT takes I/O tensors only at 256-byte aligned addresses (plan "
             "the program's memory with MemoryPlanningPass(alignment=256))";
  return InvalidArgument(message.str());
}

Status CheckOutputFits(const std::string& name, const std::vector<int64_t>& shape,
                       size_t element_size, size_t capacity) {
  size_t bytes = element_size;
  for (int64_t extent : shape) {
    if (extent < 0) {
      return InvalidArgument("output '" + name + "' has shape " + ShapeString(shape) +
                             " before the run: a data-dependent shape, which zerokv does not "
                             "support (its buffer must be bound before the run)");
    }
    const size_t unsigned_extent = static_cast<size_t>(extent);
    if (unsigned_extent != 0 && bytes > std::numeric_limits<size_t>::max() / unsigned_extent) {
      return InvalidArgument("output '" + name + "' of shape " + ShapeString(shape) +
                             " has more bytes than memory can address");
    }
    bytes *= unsigned_extent;
  }
  if (bytes > capacity) {
    return InvalidArgument("output '" + name + "' of shape " + ShapeString(shape) + " needs " +
                           std::to_string(bytes) + " bytes, but the buffer bound to it holds " +
                           std::to_string(capacity));
  }
  return Status::Ok();
}

}  // namespace zerokv::engines::tensorrt
