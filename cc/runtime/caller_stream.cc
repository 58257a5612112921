#include "cc/runtime/caller_stream.h"

namespace zerokv::runtime {
namespace {

// Defined once, in this file, so that every delegate linked with it reads the same variable.
thread_local std::optional<base::StreamHandle> caller_stream;

}  // namespace

std::optional<base::StreamHandle> CurrentCallerStream() { return caller_stream; }

CallerStreamGuard::CallerStreamGuard(base::StreamHandle stream) : previous_(caller_stream) {
  caller_stream = stream;
}

CallerStreamGuard::~CallerStreamGuard() { caller_stream = previous_; }

}  // namespace zerokv::runtime
