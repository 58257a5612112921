// The engine interface: what the zerokv delegate runtime needs from an inference engine.
//
// An engine owns a compiled network with named I/O bindings. The runtime (cc/runtime) binds the
// caller's buffers to it by name and enqueues it on a stream:
//
//   engine->SetInputShape("tokens", {1, 7});
//   engine->SetAddress("tokens", tokens_ptr, tokens_capacity);
//   engine->SetAddress("k_cache_out", k_cache_ptr, k_cache_capacity);  // aliased: the input's pointer
//   engine->Enqueue(stream);
//   engine->OutputShape("logits", &shape);
//
// Aliased I/O: an output the engine writes *through* an input's buffer (a KV cache updated in
// place) is reported by AliasedInput(). The runtime never takes the blob's word for an alias: it
// checks the blob against what the engine reports, because an alias the blob misses means the
// engine overwrites a caller buffer nobody expects to change.
//
// Engines are created by the factory registered for their blob::EngineKind (RegisterEngineFactory
// below, at static initialisation of the engine's library), from the blob and the program's named
// data (ExecuTorch's NamedDataMap: the .ptd beside the .pte, or the .pte's own segment), where the
// blob's engine_key and constants live.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/named_data_map.h>

#include "cc/base/device_ops.h"
#include "cc/base/status.h"
#include "cc/blob/blob.h"

namespace zerokv::engines {

using base::ComputeDevice;
using base::Status;
using base::StreamHandle;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::NamedDataMap;

struct EngineBinding {
  std::string name;
  blob::Direction direction;
  blob::DType dtype;
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual ComputeDevice compute_device() const = 0;

  // Every I/O binding of the engine, inputs and outputs, in the engine's own order.
  virtual const std::vector<EngineBinding>& bindings() const = 0;

  // The input whose buffer output `output` is written through, or nullopt when it is not aliased.
  virtual std::optional<std::string> AliasedInput(const std::string& output) const = 0;

  // The shape of input `name` for the next Enqueue.
  virtual Status SetInputShape(const std::string& name, const std::vector<int64_t>& shape) = 0;

  // Binds `name` to `capacity` bytes at `data` for the next Enqueue. `data` is device memory on a
  // CUDA engine. An aliased output is bound to its input's address.
  virtual Status SetAddress(const std::string& name, void* data, size_t capacity) = 0;

  // Runs the network on `stream` over the bound addresses. Returns when the work is enqueued (a
  // host engine has finished by then).
  virtual Status Enqueue(StreamHandle stream) = 0;

  // Readies the engine for the shapes and addresses bound since the last Enqueue, without running
  // anything, for a later Enqueue that binds the same: an engine whose first run of a binding
  // costs the host time (capturing a CUDA graph) spends it now, so that the step that switches to
  // that binding does not. Nothing reads or writes the bound addresses here. It binds nothing for
  // the next Enqueue, whose caller sets every binding again. By default there is nothing to ready.
  virtual Status Prepare(StreamHandle stream) {
    (void)stream;
    return Status::Ok();
  }

  // The shape output `name` has after the last Enqueue.
  virtual Status OutputShape(const std::string& name, std::vector<int64_t>* shape) const = 0;
};

// Creates the engine recorded in a parsed blob (its payload, device_id and bindings), reading what
// the blob keeps in named data from `named_data` (nullptr when the program has none).
using EngineFactory = std::function<Status(const blob::Blob& blob, const NamedDataMap* named_data,
                                           std::unique_ptr<Engine>* engine)>;

// Registers the factory for `kind`; one per kind. Called at static initialisation by an engine
// library (alwayslink), so linking the library is what makes its engine kind loadable.
bool RegisterEngineFactory(blob::EngineKind kind, EngineFactory factory);

// Creates the engine for blob.engine_kind, or says that no engine of that kind is linked in.
Status CreateEngine(const blob::Blob& blob, const NamedDataMap* named_data, std::unique_ptr<Engine>* engine);

// The named data entry `key` (`what` says what it is, for the error), as the NamedDataMap hands it
// out (mapped, with ExecuTorch's mmap data loader), or an error saying that it is missing.
Status GetNamedData(const NamedDataMap* named_data, const std::string& key, const std::string& what,
                    std::optional<FreeableBuffer>* data);

}  // namespace zerokv::engines
