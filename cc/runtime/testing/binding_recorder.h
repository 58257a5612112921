// Test-only: records the binding trace (cc/runtime/binding_trace.h) of every zerokv Execute in the
// process, so that tests running delegates through ExecuTorch can prove the engine wrote through
// the caller's buffer. Linking it installs the trace; `zerokv_testing_bound_address` is its C form.
#pragma once

namespace zerokv::runtime::testing {

// The address `binding` was bound to by the last zerokv Execute, or nullptr.
const void* BoundAddress(const char* binding);

}  // namespace zerokv::runtime::testing
