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
// engine, goes through a delegate-owned device buffer (inputs copied in, outputs copied out).
//
// Streams: the caller's stream when a CallerStreamGuard is live (over nullptr: the legacy default
// stream), else a stream of the delegate's own. Without a caller stream nothing outside zerokv can
// order work after ours, so execute finishes its own stream before returning, whatever reads the
// results next (ExecuTorch's copies through any DeviceAllocator, a device-resident method output,
// another backend). On a caller stream execute returns with the work in flight (a staged output
// excepted: the caller reads it on the host; and a staged input in page-locked memory, which the
// copy reads only when the stream reaches it while the caller may write it once execute returns)
// and records an event that the next execute's stream waits on and destruction drains.
//
// Runtime-owned KV caches (the blob's kv_layers): their K and V inputs, and the outputs aliased to
// them, are not arguments. Each execute runs on a sequence (cc/kvcache/sequence.h): the one current
// on the thread, else the delegate's home (current at load, or the implicit sequence), whose cache
// of each layer's storage_key it binds. The delegate owns the step: before the run it reads the
// step's token count from the argument the blob's step_width_source names (its extent along that
// dim: shape metadata, never device contents), holds each cache for the step (refused while another
// step or a reset holds one), grows it on the run's stream, binds the K/V inputs and their aliased
// outputs at [batch, heads, capacity, head_dim], and binds the blob's positions_binding (and each
// ring layer's slots_binding) to a buffer of its own, filled on the run's stream with the step's
// positions [length, length + step) from the committed length (a ring's slots modulo its window).
// The caller's tensor for those inputs supplies the shape only: its values are never read. After a
// successful run it prepares at most one cache's next growth ahead (KVCache::PrepareGrowth), so
// that the layers' allocations are spread over the steps before the growth instead of all landing
// in it, releases at most one cache's storage that a growth retired (KVCache::ReleaseRetired),
// spreading the releases over the steps after it, and commits the step; a refused or failed
// execute never advances a cache, so a retry writes the same positions again.
//
// Threads: one delegate serves one thread at a time (ExecuTorch runs a method's instructions in
// order); different delegates execute concurrently, each on its own sequence.
//
// Errors: every check on the arguments (and on the caches' room for the step) runs before anything
// is bound, copied or enqueued, so a refused execute leaves the caller's buffers untouched. Each
// message names the argument and binding at fault.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/span.h>

#include "cc/base/status.h"
#include "cc/blob/blob.h"
#include "cc/engines/engine.h"
#include "cc/kvcache/kv_cache.h"
#include "cc/kvcache/sequence.h"
#include "cc/runtime/device_ops.h"

namespace zerokv::runtime {

class Delegate {
 public:
  // Checks the blob against the engine: the same bindings (name, direction, dtype), the same
  // aliased I/O in both directions, no duplicate alias, and a recorded elision that the engine's
  // aliases can honour. Each KV layer's K and V bindings must have a static batch and a positions
  // dim that admits every capacity the cache may take; its cache is acquired here from the home
  // sequence (refused when held there with another layout or device), allocated at the first step.
  // positions_binding and slots_binding need bounded dims (the runtime's buffer for them holds the
  // largest). The KV layers' home is the sequence current on this thread, else the implicit one,
  // which refuses a second delegate of `method` (the ExecuTorch method's name) over its storage.
  static Status Create(const blob::Blob& blob, std::unique_ptr<engines::Engine> engine,
                       std::unique_ptr<DeviceOps> ops, const std::string& method,
                       std::unique_ptr<Delegate>* delegate);

  // Drains the in-flight work, then frees the engine, the staging buffers and the stream.
  ~Delegate();

  Delegate(const Delegate&) = delete;
  Delegate& operator=(const Delegate&) = delete;

  Status Execute(executorch::runtime::Span<executorch::runtime::EValue*> args);

  // How many arguments Execute takes.
  size_t arity() const { return signature_.arity(); }

  // The address binding `name` was bound to by the last Execute that bound it (nullptr before
  // one): what tests compare with the caller's buffer, or the cache's storage, to prove the engine
  // wrote through it.
  const void* bound_address(const std::string& name) const;

 private:
  struct Binding {
    blob::IOBinding spec;
    std::optional<size_t> argument;       // index in the delegate arguments; nullopt when elided
    std::optional<size_t> aliased_input;  // an aliased output: index of its input in bindings_
    bool alias_target = false;            // an input some output is written through
    // Bytes at the largest shape the blob allows; nullopt when a dim is unbounded or they overflow.
    std::optional<size_t> max_bytes;
    void* staging = nullptr;              // device buffer: a host-resident argument's, or the fill's
    void* bound = nullptr;                // address bound at the last Execute
    size_t bound_bytes = 0;               // bytes bound there
    // The last argument address confirmed as CUDA memory: an argument is asked about (a CUDA driver
    // call) only when its address changes, not at every step.
    const void* confirmed_on_device = nullptr;
    std::optional<size_t> layer;          // a runtime-owned input: its layer, index into layers_
    bool cache_value = false;             // ... the V tensor of it (else K)
    // An argument the runtime fills with the step's positions, modulo this when nonzero (a ring's
    // write slots); `fill` is the host copy of those values.
    std::optional<uint64_t> positions_modulo;
    std::vector<uint8_t> fill;
  };
  struct Layer {
    std::string storage_key;
    kvcache::KVCacheConfig config;
  };
  struct Plan;  // What Execute decided for each argument, before touching anything.

  Delegate(std::unique_ptr<engines::Engine> engine, std::shared_ptr<DeviceOps> ops);

  Status PlanCaches(const blob::Blob& blob, const std::unordered_map<std::string, size_t>& index_of);
  Status Validate(executorch::runtime::Span<executorch::runtime::EValue*> args, Plan* plan);
  // The caches of the sequence this execute runs on.
  Status UseSequence(const std::shared_ptr<kvcache::Sequence>& sequence);
  // Holds every cache for the step and reads its first position; on failure holds none.
  Status BeginStep(Plan* plan);
  // Binds everything, enqueues the engine and the outputs' copies and prepares a growth ahead, on
  // `stream`; records the done event unless the plan synchronizes (Execute then finishes the stream
  // once the caches' uses are recorded).
  Status Run(Plan& plan, StreamHandle stream);
  Status FillPositions(size_t index, const Plan& plan, StreamHandle stream);
  // After a successful run, on its stream: the first cache that reserves its next capacity does.
  // True when none did and none failed to: every reserve the caches take ahead is in place.
  bool PrepareGrowthAhead(const Plan& plan, StreamHandle stream);
  // Then, on the same stream: readies the engine for the binding the growth step will have.
  void PrepareEngineForGrowth(StreamHandle stream);
  // After a successful run, on its stream: the first cache holding storage a growth retired
  // releases it.
  void ReleaseRetiredStorage(StreamHandle stream);
  Status EnsureStaging(Binding& binding);
  // Whether a staged input of the plan is copied from page-locked host memory.
  bool StagesFromPageLockedMemory(const Plan& plan) const;
  Status Drain();

  std::unique_ptr<engines::Engine> engine_;
  std::shared_ptr<DeviceOps> ops_;  // shared with the KV caches this delegate created
  std::vector<Binding> bindings_;
  std::string method_;
  int device_id_ = 0;  // the CUDA device an engine on CUDA runs on
  std::vector<Layer> layers_;
  std::shared_ptr<kvcache::Sequence> home_;  // where loads placed the caches; executes default here
  std::vector<std::shared_ptr<kvcache::KVCache>> caches_;  // of sequence_id_, indexed like layers_
  std::vector<std::pair<void*, int64_t>> engine_prepared_for_;  // the reserves the engine was readied for
  uint64_t sequence_id_ = 0;
  size_t step_binding_ = 0;  // the binding (an argument input) whose extent is the step width
  size_t step_dim_ = 0;
  blob::DelegateSignature signature_;
  bool aliased_outputs_elided_ = false;
  StreamHandle own_stream_ = nullptr;
  EventHandle done_event_ = nullptr;
  bool in_flight_ = false;
  void* empty_tensor_address_ = nullptr;  // bound for zero-byte tensors, which may have no data
};

}  // namespace zerokv::runtime
