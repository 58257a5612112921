// A Status: an ExecuTorch Error code plus the message that says what failed and why.
//
// ExecuTorch's Error alone cannot name the binding or argument at fault; every zerokv refusal does.
// The backend logs the message (ET_LOG) and hands the code to ExecuTorch.
//
//   Status status = delegate.Execute(args);
//   if (!status.ok()) ET_LOG(Error, "%s", status.message().c_str());
#pragma once

#include <string>
#include <utility>

#include <executorch/runtime/core/error.h>

namespace zerokv::base {

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(executorch::runtime::Error code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == executorch::runtime::Error::Ok; }
  executorch::runtime::Error code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  executorch::runtime::Error code_ = executorch::runtime::Error::Ok;
  std::string message_;
};

inline Status InvalidArgument(std::string message) {
  return Status(executorch::runtime::Error::InvalidArgument, std::move(message));
}
inline Status InvalidProgram(std::string message) {
  return Status(executorch::runtime::Error::InvalidProgram, std::move(message));
}
inline Status Internal(std::string message) {
  return Status(executorch::runtime::Error::Internal, std::move(message));
}
inline Status InvalidState(std::string message) {
  return Status(executorch::runtime::Error::InvalidState, std::move(message));
}
inline Status NotSupported(std::string message) {
  return Status(executorch::runtime::Error::NotSupported, std::move(message));
}

}  // namespace zerokv::base

// Returns early from the enclosing function when `expr` is not ok.
#define ZEROKV_RETURN_IF_ERROR(expr)                        \
  do {                                                      \
    ::zerokv::base::Status zerokv_status_ = (expr);      \
    if (!zerokv_status_.ok()) return zerokv_status_;        \
  } while (0)
