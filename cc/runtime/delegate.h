// A Delegate: one zerokv delegate instance, i.e. one engine and the rules for binding ExecuTorch's
// delegate arguments to it. The BackendInterface (backend.cc) is a thin shell over this class; tests
// drive it directly with an engine of their own.
//
// Arguments: exactly the bindings blob::ComputeDelegateSignature names, inputs then outputs, in
// blob order. Whether the aliased outputs are among them is read from the blob's recorded elision,
// never inferred from how many arguments arrive.
//
// Aliasing: every aliased output is bound to its input's address, so the engine's update lands in
// the caller's buffer. That buffer must be device-resident: ExecuTorch planned it in CUDA memory
// (its TensorImpl says DeviceType::CUDA) and, on a CUDA engine, cudaPointerGetAttributes agrees.
// A host-resident alias target is refused, because staging it would discard the update.
//
// Staging: a non-aliased argument that is host-resident while its binding is on CUDA, on a CUDA
// engine, goes through a delegate-owned device buffer (inputs copied in, outputs copied out). Only
// a staged output makes execute synchronize; otherwise it returns with the work in flight.
//
// Streams: the caller's stream (CallerStreamGuard) when one is set, else a stream of the
// delegate's own. An event recorded at the end of each unsynchronized execute is waited on by the
// next execute's stream and drained before destruction.
//
// Errors: every check on the arguments runs before anything is bound, copied or enqueued, so a
// refused execute leaves the caller's buffers untouched. Each message names the argument and
// binding at fault.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/span.h>

#include "cc/blob/blob.h"
#include "cc/engines/engine.h"
#include "cc/runtime/device_ops.h"
#include "cc/runtime/status.h"

namespace zerokv::runtime {

class Delegate {
 public:
  // Checks the blob against the engine: the same bindings (name, direction, dtype), the same
  // aliased I/O in both directions, no duplicate alias, and a recorded elision that the engine's
  // aliases can honour. Runtime-owned KV caches (kv_layers) are not supported by this runtime.
  static Status Create(const blob::Blob& blob, std::unique_ptr<engines::Engine> engine,
                       std::unique_ptr<DeviceOps> ops, std::unique_ptr<Delegate>* delegate);

  // Drains the in-flight work, then frees the engine, the staging buffers and the stream.
  ~Delegate();

  Delegate(const Delegate&) = delete;
  Delegate& operator=(const Delegate&) = delete;

  Status Execute(executorch::runtime::Span<executorch::runtime::EValue*> args);

  // How many arguments Execute takes.
  size_t arity() const { return signature_.arity(); }

  // The address binding `name` was bound to by the last successful Execute (nullptr before one):
  // what tests compare with the caller's buffer to prove the engine wrote through it.
  const void* bound_address(const std::string& name) const;

 private:
  struct Binding {
    blob::IOBinding spec;
    std::optional<size_t> argument;       // index in the delegate arguments; nullopt when elided
    std::optional<size_t> aliased_input;  // an aliased output: index of its input in bindings_
    bool alias_target = false;            // an input some output is written through
    size_t max_bytes = 0;                 // bytes at the largest shape the blob allows
    void* staging = nullptr;              // device buffer for a host-resident argument
    void* bound = nullptr;                // address bound at the last Execute
  };
  struct Plan;  // What Execute decided for each argument, before touching anything.

  Delegate(std::unique_ptr<engines::Engine> engine, std::unique_ptr<DeviceOps> ops);

  Status Validate(executorch::runtime::Span<executorch::runtime::EValue*> args, Plan* plan);
  Status EnsureStaging(Binding& binding);
  Status Drain();

  std::unique_ptr<engines::Engine> engine_;
  std::unique_ptr<DeviceOps> ops_;
  std::vector<Binding> bindings_;
  blob::DelegateSignature signature_;
  bool aliased_outputs_elided_ = false;
  StreamHandle own_stream_ = nullptr;
  EventHandle done_event_ = nullptr;
  bool in_flight_ = false;
  void* empty_tensor_address_ = nullptr;  // bound for zero-byte tensors, which may have no data
};

}  // namespace zerokv::runtime
