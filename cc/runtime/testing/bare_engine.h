// A zerokv delegate's engine run alone, for the benches: the floor under the runtime.
//
// Every binding of the blob is bound to a device buffer of its largest shape (an aliased output to
// its input's buffer), and a step is Enqueue plus a stream synchronize: no ExecuTorch, no binding
// checks, no copies around it (StepWithHostIO adds the host's). A failure exits with a message
// naming the blob: a bench has nothing to recover.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <executorch/extension/data_loader/mmap_data_loader.h>
#include <executorch/extension/flat_tensor/flat_tensor_data_map.h>

#include "cc/blob/blob.h"
#include "cc/engines/engine.h"

namespace zerokv::testing {

class BareEngine {
 public:
  // `blob_path`: the delegate blob; `data_path`: its program's .ptd, where the blob's weights are.
  BareEngine(const std::string& blob_path, const std::string& data_path);
  ~BareEngine();
  BareEngine(const BareEngine&) = delete;
  BareEngine& operator=(const BareEngine&) = delete;

  // Writes `position` into every int64 input whose name says "position".
  void SetPosition(int64_t position);

  void Step();

  // A step as a runtime serving a host caller makes it: `token` into the int64 input that is not a
  // position and `position` into those that are, copied from the host on the engine's stream
  // before Enqueue, and every output that aliases no input copied back to the host after it. The
  // host's side of each copy is page-locked, as zerokv's programs' host buffers are in the benches
  // (PinnedPlannedMemory).
  void StepWithHostIO(int64_t token, int64_t position);

 private:
  void Require(const base::Status& status, const std::string& what) const;
  // `bytes` of page-locked host memory, freed with the engine.
  void* HostBuffer(size_t bytes, const std::string& name);

  std::string path_;
  std::vector<uint8_t> bytes_;
  blob::Blob blob_;
  std::optional<executorch::extension::MmapDataLoader> loader_;
  std::optional<executorch::extension::FlatTensorDataMap> named_data_;
  std::unique_ptr<engines::Engine> engine_;
  std::map<std::string, void*> address_;
  std::vector<void*> owned_;
  std::vector<void*> owned_host_;  // page-locked
  struct HostInput {
    void* device;
    int64_t* host;
    bool is_position;
  };
  struct HostOutput {
    std::string name;
    void* device;
    size_t element_bytes;
    void* host;  // its largest shape's bytes
    size_t host_bytes;
  };
  std::vector<HostInput> host_inputs_;    // StepWithHostIO's int64 inputs
  std::vector<HostOutput> host_outputs_;  // and the outputs it copies back
  cudaStream_t stream_ = nullptr;
};

}  // namespace zerokv::testing
