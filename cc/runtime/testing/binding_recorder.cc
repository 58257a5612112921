#include "cc/runtime/testing/binding_recorder.h"

#include <map>
#include <mutex>
#include <string>

#include "cc/runtime/binding_trace.h"

namespace zerokv::runtime::testing {
namespace {

struct Recorded {
  std::mutex mutex;
  std::map<std::string, const void*> bound;  // binding -> address at the last Execute
};

Recorded& TheRecord() {
  static auto* record = new Recorded();  // never destroyed: delegates may execute until exit
  return *record;
}

void Record(const char* binding, const void* address) {
  std::lock_guard<std::mutex> lock(TheRecord().mutex);
  TheRecord().bound[binding] = address;
}

const bool installed = [] {
  SetBindingTrace(Record);
  return true;
}();

}  // namespace

const void* BoundAddress(const char* binding) {
  std::lock_guard<std::mutex> lock(TheRecord().mutex);
  auto found = TheRecord().bound.find(binding);
  return found == TheRecord().bound.end() ? nullptr : found->second;
}

}  // namespace zerokv::runtime::testing

extern "C" const void* zerokv_testing_bound_address(const char* binding) {
  return zerokv::runtime::testing::BoundAddress(binding);
}
