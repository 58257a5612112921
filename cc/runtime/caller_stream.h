// The caller's CUDA stream: one thread-local shared by every zerokv delegate.
//
// A runner that drives its own stream installs it for the calls it makes on this thread:
//
//   {
//     zerokv::runtime::CallerStreamGuard guard(my_stream);
//     method.execute();   // every zerokv delegate enqueues on my_stream, without synchronizing
//   }
//
// Without a guard, each delegate runs on a stream of its own and orders consecutive executes with
// an event. Guards nest; the destructor restores the stream that was current before.
#pragma once

#include "cc/engines/engine.h"

namespace zerokv::runtime {

// The stream installed by the innermost live CallerStreamGuard on this thread, or nullptr.
engines::StreamHandle CurrentCallerStream();

class CallerStreamGuard {
 public:
  explicit CallerStreamGuard(engines::StreamHandle stream);
  ~CallerStreamGuard();

  CallerStreamGuard(const CallerStreamGuard&) = delete;
  CallerStreamGuard& operator=(const CallerStreamGuard&) = delete;

 private:
  engines::StreamHandle previous_;
};

}  // namespace zerokv::runtime
