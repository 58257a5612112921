// The caller's CUDA stream: one thread-local shared by every zerokv delegate.
//
// A runner that drives its own stream installs it for the calls it makes on this thread:
//
//   {
//     zerokv::runtime::CallerStreamGuard guard(my_stream);
//     method.execute();   // every zerokv delegate enqueues on my_stream, without synchronizing
//   }
//
// Without a guard, each delegate runs on a stream of its own and synchronizes it before execute
// returns: nothing outside zerokv can order work after that stream, so the results must be
// complete when the caller (ExecuTorch's output copies, a device-resident output's reader, another
// backend) gets them. A guard over nullptr is a selection like any other: the legacy default
// stream. Guards nest; the destructor restores the selection that was current before.
#pragma once

#include <optional>

#include "cc/base/device_ops.h"

namespace zerokv::runtime {

// The stream installed by the innermost live CallerStreamGuard on this thread (nullptr: the legacy
// default stream), or nullopt when no guard is live.
std::optional<base::StreamHandle> CurrentCallerStream();

class CallerStreamGuard {
 public:
  explicit CallerStreamGuard(base::StreamHandle stream);
  ~CallerStreamGuard();

  CallerStreamGuard(const CallerStreamGuard&) = delete;
  CallerStreamGuard& operator=(const CallerStreamGuard&) = delete;

 private:
  std::optional<base::StreamHandle> previous_;
};

}  // namespace zerokv::runtime
