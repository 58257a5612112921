#include "cc/runtime/binding_trace.h"

#include <atomic>

namespace zerokv::runtime {
namespace {

std::atomic<BindingTrace> binding_trace{nullptr};

}  // namespace

void SetBindingTrace(BindingTrace trace) { binding_trace.store(trace); }

BindingTrace GetBindingTrace() { return binding_trace.load(); }

}  // namespace zerokv::runtime
