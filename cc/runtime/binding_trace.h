// A process-wide observer of what each Execute bound, for tests that run delegates through
// ExecuTorch (where the delegate handle is out of reach) and must prove that the engine wrote
// through the caller's buffer. Unset (nullptr) it costs one load per Execute.
#pragma once

namespace zerokv::runtime {

// Called after each successful enqueue, once per binding, with the address the engine was given.
using BindingTrace = void (*)(const char* binding, const void* address);

void SetBindingTrace(BindingTrace trace);
BindingTrace GetBindingTrace();

}  // namespace zerokv::runtime
