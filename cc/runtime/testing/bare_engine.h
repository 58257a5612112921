// A zerokv delegate's engine run alone, for the benches: the floor under the runtime.
//
// Every binding of the blob is bound to a device buffer of its largest shape (an aliased output to
// its input's buffer), and a step is Enqueue plus a stream synchronize: no ExecuTorch, no binding
// checks, no copies around it. A failure exits with a message naming the blob: a bench has nothing
// to recover.
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

 private:
  void Require(const base::Status& status, const std::string& what) const;

  std::string path_;
  std::vector<uint8_t> bytes_;
  blob::Blob blob_;
  std::optional<executorch::extension::MmapDataLoader> loader_;
  std::optional<executorch::extension::FlatTensorDataMap> named_data_;
  std::unique_ptr<engines::Engine> engine_;
  std::map<std::string, void*> address_;
  std::vector<void*> owned_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace zerokv::testing
