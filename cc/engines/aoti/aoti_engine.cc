#include "cc/engines/aoti/aoti_engine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#ifdef ZEROKV_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef ZEROKV_WITH_TORCH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cc/engines/aoti/dependent_launch.h"
#endif

namespace zerokv::engines {
namespace {

std::atomic<uint64_t> cuda_graph_replays{0};
std::atomic<uint64_t> cuda_graph_updates{0};
std::atomic<uint64_t> cuda_graphs_captured_ahead{0};
std::atomic<uint64_t> dependent_launch_edges{0};
std::atomic<uint64_t> dependent_launch_graphs{0};

using base::Internal;
using base::InvalidProgram;

std::vector<std::string> Split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  if (text.empty()) return parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, separator)) parts.push_back(part);
  return parts;
}

bool ParseDType(const std::string& name, blob::DType* dtype) {
  for (blob::DType candidate :
       {blob::DType::kFloat32, blob::DType::kFloat16, blob::DType::kBfloat16, blob::DType::kInt32,
        blob::DType::kInt64, blob::DType::kInt8, blob::DType::kUint8, blob::DType::kBool}) {
    if (name == blob::ToString(candidate)) {
      *dtype = candidate;
      return true;
    }
  }
  return false;
}

// A parsed blob's dtypes are all valid (blob::Parse), so every one has a code.
at::ScalarType ToTorch(blob::DType dtype) {
  return static_cast<at::ScalarType>(*blob::ScalarTypeCode(dtype));
}

// The payload (kernel code and metadata, no weights) as a file in memory, for
// AOTIModelPackageLoader, which takes a path: it opens /proc/self/fd/N like any file, with no
// suffix required. Nothing of the engine's goes to disk, and the copy is freed once the loader has
// read it. The loader itself (torch 2.13) still unpacks the package into
// $TMPDIR/aotinductor_XXXXXX (wrapper .so, kernel sources, metadata JSON) and loads the .so from
// there until it is destroyed: it has no in-memory route, and $TMPDIR is the one knob.
class InMemoryPackage {
 public:
  InMemoryPackage() = default;
  InMemoryPackage(const InMemoryPackage&) = delete;
  InMemoryPackage& operator=(const InMemoryPackage&) = delete;
  ~InMemoryPackage() {
    if (fd_ >= 0) ::close(fd_);
  }

  Status Write(const uint8_t* data, size_t size) {
    fd_ = memfd_create("zerokv_aoti_package", MFD_CLOEXEC);
    if (fd_ < 0) {
      return Internal(std::string("cannot create an in-memory file for the AOTInductor package: ") +
                      std::strerror(errno));
    }
    for (size_t written = 0; written < size;) {
      const ssize_t n = ::write(fd_, data + written, size - written);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        return Internal("cannot write the AOTInductor package (" + std::to_string(size) +
                        " bytes) to an in-memory file: " +
                        (n < 0 ? std::strerror(errno) : "the write made no progress"));
      }
      written += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
    if (::access(path_.c_str(), R_OK) != 0) {
      return Internal("the in-memory AOTInductor package cannot be opened as " + path_ +
                      " (is /proc mounted?): " + std::strerror(errno));
    }
    return Status::Ok();
  }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// The package in the blob's payload, loaded by libtorch. Its in-memory copy goes once the loader
// has read it.
Status LoadPackage(const blob::Blob& blob,
                   std::unique_ptr<torch::inductor::AOTIModelPackageLoader>* loader) {
  InMemoryPackage package;
  ZEROKV_RETURN_IF_ERROR(package.Write(blob.payload, blob.payload_size));
  try {
    // Single-threaded: the runtime runs a delegate on one thread at a time and orders its runs on
    // their streams; the threaded container would also query an event of its last run, which a CUDA
    // graph capture refuses (and which a captured run leaves unusable).
    *loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package.path(), "model",
                                                                        /*run_single_threaded=*/true);
  } catch (const std::exception& error) {
    return InvalidProgram(std::string("the AOTInductor payload does not load: ") + error.what());
  }
  return Status::Ok();
}

// A named data entry as an engine's constants read it.
struct Entry {
  std::optional<FreeableBuffer> mapped;  // a host engine's constants view these bytes
  at::Tensor bytes;                      // uint8 [size], on the engine's device
};

// The entry `key` of `named_data` on `device`. On the CPU, the bytes the NamedDataMap hands out
// (mapped by ExecuTorch's mmap data loader), owned by this engine: they belong to its program's
// data loader. On a CUDA device, a copy shared by every engine of the process that reads the key
// (a program's prefill and decode delegates): copied there once while any engine holds it. Keys
// are the content's hash (zerokv/<sha256>, py/zerokv/aoti), so equal keys are equal bytes.
Status AcquireEntry(const NamedDataMap* named_data, const std::string& key, const std::string& what,
                    const at::Device& device, std::shared_ptr<Entry>* entry) {
  auto read = [&](std::shared_ptr<Entry>* created) {
    *created = std::make_shared<Entry>();
    ZEROKV_RETURN_IF_ERROR(GetNamedData(named_data, key, what, &(*created)->mapped));
    (*created)->bytes = at::from_blob(const_cast<void*>((*created)->mapped->data()),
                                      {static_cast<int64_t>((*created)->mapped->size())}, at::kByte);
    return Status::Ok();
  };
  if (device.is_cpu()) return read(entry);

  static std::mutex mutex;
  static auto* shared = new std::map<std::string, std::weak_ptr<Entry>>();
  std::lock_guard<std::mutex> lock(mutex);
  const std::string id = device.str() + "/" + key;
  if ((*entry = (*shared)[id].lock())) return Status::Ok();
  std::shared_ptr<Entry> created;
  ZEROKV_RETURN_IF_ERROR(read(&created));
  try {
    created->bytes = created->bytes.to(device);
  } catch (const std::exception& error) {
    return Internal(what + ": copying named data entry '" + key + "' to " + device.str() + " failed: " +
                    error.what());
  }
  created->mapped.reset();  // on the device now: the host bytes can go
  for (auto it = shared->begin(); it != shared->end();) {
    it = it->second.expired() ? shared->erase(it) : std::next(it);
  }
  (*shared)[id] = created;
  *entry = std::move(created);
  return Status::Ok();
}

// Bytes from the storage's start to the end of the last element a view reaches, or false when
// that overflows. A view with a zero extent reaches nothing.
bool ViewBytes(const blob::Constant& constant, size_t element_size, uint64_t* bytes) {
  uint64_t last = static_cast<uint64_t>(constant.storage_offset);
  for (size_t d = 0; d < constant.sizes.size(); ++d) {
    if (constant.sizes[d] == 0) {
      *bytes = 0;
      return true;
    }
    uint64_t reach = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(constant.sizes[d] - 1),
                               static_cast<uint64_t>(constant.strides[d]), &reach) ||
        __builtin_add_overflow(last, reach, &last)) {
      return false;
    }
  }
  return !__builtin_add_overflow(last, 1, &last) && !__builtin_mul_overflow(last, element_size, bytes);
}

class AotiEngine final : public Engine {
 public:
  Status Load(const blob::Blob& blob, const NamedDataMap* named_data) {
#ifdef ZEROKV_WITH_CUDA
    // A CUDA package loads onto the current device. Which kind the package is, its metadata says
    // only once it is loaded; a host package needs no device, so a machine without a GPU (where
    // this fails) still loads those, and a CUDA package reports the failure below.
    const cudaError_t selected = cudaSetDevice(blob.device_id);
    if (selected != cudaSuccess) cudaGetLastError();  // for a host package, no error: cleared
#endif
    ZEROKV_RETURN_IF_ERROR(LoadPackage(blob, &loader_));
    auto table = loader_->get_metadata();
    ZEROKV_RETURN_IF_ERROR(ReadBindings(std::map<std::string, std::string>(table.begin(), table.end())));
#ifdef ZEROKV_WITH_CUDA
    if (device_ == ComputeDevice::kCuda && selected != cudaSuccess) {
      return Internal("cannot select CUDA device " + std::to_string(blob.device_id) + ": " +
                      cudaGetErrorString(selected));
    }
#else
    if (device_ == ComputeDevice::kCuda) {
      return base::NotSupported(
          "the AOTInductor package was compiled for CUDA, but this engine was built without CUDA");
    }
#endif
    device_index_ = device_ == ComputeDevice::kCuda ? blob.device_id : -1;
    ZEROKV_RETURN_IF_ERROR(ReadCudaGraph(std::map<std::string, std::string>(table.begin(), table.end())));
    return LoadConstants(blob, named_data);
  }

  ComputeDevice compute_device() const override { return device_; }
  const std::vector<EngineBinding>& bindings() const override { return bindings_; }

  std::optional<std::string> AliasedInput(const std::string& output) const override {
    auto alias = aliases_.find(output);
    if (alias == aliases_.end()) return std::nullopt;
    return alias->second;
  }

  Status SetInputShape(const std::string& name, const std::vector<int64_t>& shape) override {
    Slot* slot = Find(name);
    if (slot == nullptr || slot->direction != blob::Direction::kInput) {
      return base::InvalidArgument("the AOTInductor engine has no input '" + name + "'");
    }
    slot->shape = shape;
    return Status::Ok();
  }

  Status SetAddress(const std::string& name, void* data, size_t capacity) override {
    Slot* slot = Find(name);
    if (slot == nullptr) {
      return base::InvalidArgument("the AOTInductor engine has no binding '" + name + "'");
    }
    slot->data = data;
    slot->capacity = capacity;
    return Status::Ok();
  }

  Status Enqueue(StreamHandle stream) override {
#ifdef ZEROKV_WITH_TORCH_CUDA
    if (cuda_graph_) return EnqueueGraph(stream);
#endif
    return Run(stream);
  }

  Status Prepare(StreamHandle stream) override {
#ifdef ZEROKV_WITH_TORCH_CUDA
    if (cuda_graph_) return PrepareGraph(stream);
#endif
    (void)stream;
    return Status::Ok();
  }

  Status OutputShape(const std::string& name, std::vector<int64_t>* shape) const override {
    for (const Slot& slot : slots_) {
      if (slot.name == name && slot.direction == blob::Direction::kOutput) {
        *shape = slot.shape;
        return Status::Ok();
      }
    }
    return base::InvalidArgument("the AOTInductor engine has no output '" + name + "'");
  }

 private:
  struct Slot {
    std::string name;
    blob::Direction direction;
    blob::DType dtype;
    std::vector<int64_t> shape;
    void* data = nullptr;
    size_t capacity = 0;
  };

  // Runs the package once on `stream` and copies its returned outputs to their bound addresses.
  Status Run(StreamHandle stream) {
    const at::Device device = TorchDevice();
    std::vector<at::Tensor> inputs;
    for (Slot& slot : slots_) {
      if (slot.direction != blob::Direction::kInput) continue;
      // No deleter: the buffer is the caller's, which is the point.
      inputs.push_back(at::from_blob(slot.data, slot.shape,
                                     at::TensorOptions().dtype(ToTorch(slot.dtype)).device(device)));
    }
    // Keep last run's outputs alive until now: their copies were enqueued on the last stream,
    // which this one has been ordered after (Delegate::Execute waits on its event).
    outputs_.clear();
    try {
      outputs_ = loader_->run(inputs, stream);
    } catch (const std::exception& error) {
      return Internal(std::string("AOTInductor run failed: ") + error.what());
    }
    size_t returned = 0;
    for (Slot& slot : slots_) {
      if (slot.direction != blob::Direction::kOutput) continue;
      if (auto alias = aliases_.find(slot.name); alias != aliases_.end()) {
        slot.shape = Find(alias->second)->shape;
        continue;
      }
      if (returned >= outputs_.size()) {
        return Internal("the AOTInductor model returned " + std::to_string(outputs_.size()) +
                        " outputs, fewer than its package's binding table lists");
      }
      ZEROKV_RETURN_IF_ERROR(CopyOut(outputs_[returned++], slot, stream));
    }
    return Status::Ok();
  }

#ifdef ZEROKV_WITH_TORCH_CUDA
  // What a captured graph baked in: every bound address with its capacity (which the captured
  // run's output copies were checked against), every input shape, and the stream. A graph replays
  // only for the binding it was captured with; a runtime-owned cache that grew (new storage) or a
  // new step width is a new binding.
  struct GraphKey {
    std::vector<std::pair<void*, size_t>> buffers;
    std::vector<std::vector<int64_t>> shapes;
    StreamHandle stream = nullptr;
    bool operator==(const GraphKey& other) const {
      return buffers == other.buffers && shapes == other.shapes && stream == other.stream;
    }
  };

  // Made torch's current stream (a guard) around a run: the package allocates its intermediates
  // and outputs on the current stream, so that a capture takes them from the graph's private pool.
  c10::cuda::CUDAStream TorchStream(StreamHandle stream) const {
    return c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream),
                                            static_cast<c10::DeviceIndex>(device_index_));
  }

  GraphKey CurrentKey(StreamHandle stream) const {
    GraphKey key;
    key.stream = stream;
    for (const Slot& slot : slots_) {
      key.buffers.emplace_back(slot.data, slot.capacity);
      if (slot.direction == blob::Direction::kInput) key.shapes.push_back(slot.shape);
    }
    return key;
  }

  // A binding seen for the first time runs as it is (its first run also initializes what a capture
  // must not: libraries' handles and workspaces, lazily loaded kernels). Seen twice in a row, it is
  // captured, and replayed for as long as it stays. A binding that differs from the captured one
  // only in its addresses and capacities (a runtime-owned cache that grew) runs the same kernels
  // with other arguments: it is captured at once and the executable graph updated in place, which
  // costs a fraction of instantiating a new one (Recapture); a binding prepared ahead (Prepare) was
  // captured then, and only updates the graph. What a run decides on the host comes from the key
  // (shapes), not from the bound data: a package that reads device data on the host needs a
  // synchronous copy, which the capture refuses. A capture that fails (that, or the legacy default
  // stream) turns graphs off for this engine, saying so once, and the run goes on uncaptured.
  Status EnqueueGraph(StreamHandle stream) {
    GraphKey key = CurrentKey(stream);
    c10::cuda::CUDAStreamGuard guard(TorchStream(stream));
    if (graph_ && graph_key_ == key) {
      return Replay();
    }
    if (graph_ && prepared_ && prepared_->key == key) {
      seen_key_ = key;
      for (size_t i = 0; i < slots_.size(); ++i) slots_[i].shape = prepared_->shapes[i];
      std::unique_ptr<at::cuda::CUDAGraph> graph = std::move(prepared_->graph);
      prepared_.reset();
      Status installed = Install(stream, std::move(graph), std::move(key));
      if (installed.ok() && graph_) cuda_graphs_captured_ahead.fetch_add(1, std::memory_order_relaxed);
      return installed;
    }
    prepared_.reset();
    if (graph_ && OnlyCachesMoved(graph_key_, key)) {
      seen_key_ = key;
      return Recapture(stream, std::move(key));
    }
    graph_.reset();
    if (!(seen_key_ == key)) {
      seen_key_ = std::move(key);
      return Run(stream);
    }
    return CaptureAndReplay(stream, std::move(key));
  }

  // The capture Recapture would make for the bound binding, made ahead of the run that needs it:
  // while a graph replays and the binding differs from it only in where the caches are. It shares
  // the replayed graph's memory pool, and may be given the blocks of that graph's outputs (released
  // by Capture) while that graph still replays into them. That holds because the two are replayed
  // one after the other on one stream (the keys' stream), and each reads only pool memory it wrote
  // in the same replay: its outputs are copied to their bound addresses inside it. The capture's
  // run sets the slots' shapes for its binding (an aliased output's, an output's that follows the
  // caches); they are kept for the switch, and the slots restored, so that the runs until then
  // report theirs.
  Status PrepareGraph(StreamHandle stream) {
    GraphKey key = CurrentKey(stream);
    if (!graph_ || graph_key_ == key || !OnlyCachesMoved(graph_key_, key) ||
        (prepared_ && prepared_->key == key)) {
      return Status::Ok();
    }
    prepared_.reset();
    c10::cuda::CUDAStreamGuard guard(TorchStream(stream));
    const std::vector<Slot> bound = slots_;
    auto graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true);
    Status captured = Capture(stream, *graph, graph_->pool());
    std::vector<std::vector<int64_t>> shapes;
    for (const Slot& slot : slots_) shapes.push_back(slot.shape);
    slots_ = bound;
    if (!captured.ok()) {
      graph_.reset();
      return captured;
    }
    prepared_ = PreparedGraph{std::move(graph), std::move(key), std::move(shapes)};
    return Status::Ok();
  }

  // Whether `to` differs from `from` only in where the aliased inputs (the caches the package
  // writes in place) are and how many positions they hold: the other inputs keep their shapes, the
  // caches their ranks, and the stream is the same.
  bool OnlyCachesMoved(const GraphKey& from, const GraphKey& to) const {
    if (from.stream != to.stream || from.shapes.size() != to.shapes.size()) return false;
    size_t input = 0;
    for (const Slot& slot : slots_) {
      if (slot.direction != blob::Direction::kInput) continue;
      const bool cache = std::any_of(aliases_.begin(), aliases_.end(),
                                     [&](const auto& alias) { return alias.second == slot.name; });
      const std::vector<int64_t>& was = from.shapes[input];
      const std::vector<int64_t>& is = to.shapes[input];
      if (cache ? was.size() != is.size() : was != is) return false;
      ++input;
    }
    return true;
  }

  // Captures a run into `graph` (from `pool`, the memory pool of the graph it may replace, or a new
  // one), leaving its outputs in outputs_. On failure turns graphs off and says why.
  Status Capture(StreamHandle stream, at::cuda::CUDAGraph& graph, at::cuda::MempoolId_t pool) {
    outputs_.clear();
    Status captured = Status::Ok();
    try {
      // Thread-local: a call in this thread that a graph cannot hold (a synchronous copy, a host
      // read of device data) fails the capture instead of running outside it; other threads (another
      // delegate) go on as they are.
      graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      captured = Run(stream);
      graph.capture_end();  // ends the capture whether or not the run succeeded
    } catch (const std::exception& error) {
      if (captured.ok()) captured = Internal(error.what());
    }
    if (captured.ok()) captured = LetKernelsLaunchEarly(graph);
    if (!captured.ok()) {
      cudaGetLastError();  // the capture's error, reported below
      outputs_.clear();
      cuda_graph_ = false;
      std::fprintf(stderr, "zerokv: AOTInductor engine: CUDA graphs off, running each step as it is: the "
                           "capture failed: %s\n", captured.message().c_str());
    }
    return captured;
  }

  Status CaptureAndReplay(StreamHandle stream, GraphKey key) {
    auto graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true);  // edited, then instantiated
    if (!Capture(stream, *graph, {0, 0}).ok()) return Run(stream);
    try {
      graph->instantiate();
    } catch (const std::exception& error) {
      cuda_graph_ = false;
      std::fprintf(stderr, "zerokv: AOTInductor engine: CUDA graphs off, running each step as it is: "
                           "instantiating a capture failed: %s\n", error.what());
      outputs_.clear();
      return Run(stream);
    }
    graph_ = std::move(graph);
    graph_key_ = std::move(key);
    return Replay();
  }

  // The new capture shares the replaced graph's memory pool: only one of the two is ever replayed,
  // and the capture reuses what the old one no longer needs (outputs_ were released before it).
  // When CUDA cannot update the executable graph (another topology: the package took another path
  // for these sizes), the capture is instantiated instead.
  Status Recapture(StreamHandle stream, GraphKey key) {
    auto graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true);
    if (!Capture(stream, *graph, graph_->pool()).ok()) {
      graph_.reset();
      return Run(stream);
    }
    return Install(stream, std::move(graph), std::move(key));
  }

  // Makes `graph` (captured with keep_graph into graph_'s pool, for `key`) the replayed one and
  // replays it on `stream`.
  Status Install(StreamHandle stream, std::unique_ptr<at::cuda::CUDAGraph> graph, GraphKey key) {
    cudaGraphExecUpdateResultInfo result{};
    if (cudaGraphExecUpdate(graph_->raw_cuda_graph_exec(), graph->raw_cuda_graph(), &result) == cudaSuccess) {
      cuda_graph_updates.fetch_add(1, std::memory_order_relaxed);
    } else {
      cudaGetLastError();  // the update's refusal: instantiating is the answer to it
      try {
        graph->instantiate();
      } catch (const std::exception& error) {
        graph_.reset();
        cuda_graph_ = false;
        std::fprintf(stderr, "zerokv: AOTInductor engine: CUDA graphs off, running each step as it is: "
                             "instantiating a capture failed: %s\n", error.what());
        outputs_.clear();
        return Run(stream);
      }
      graph_ = std::move(graph);
    }
    graph_key_ = std::move(key);
    return Replay();
  }

  // Makes the edges into the package's waiting kernels programmatic in a capture
  // (dependent_launch.h). A failure that leaves the graph whole only stops doing it, saying so once;
  // one that leaves it without an edge fails the capture.
  Status LetKernelsLaunchEarly(at::cuda::CUDAGraph& graph) {
    if (early_kernels_.empty()) return Status::Ok();
    int edges = 0;
    bool intact = true;
    Status made = engines::LetKernelsLaunchEarly(graph.raw_cuda_graph(), early_kernels_, &edges, &intact);
    if (!made.ok()) {
      early_kernels_.clear();
      std::fprintf(stderr, "zerokv: AOTInductor engine: every kernel launches after the one before it ends from "
                           "now on: %s\n", made.message().c_str());
      if (!intact) return made;
    }
    if (edges > 0) {
      dependent_launch_edges.fetch_add(edges, std::memory_order_relaxed);
      dependent_launch_graphs.fetch_add(1, std::memory_order_relaxed);
    }
    return Status::Ok();
  }

  Status Replay() {
    try {
      graph_->replay();
    } catch (const std::exception& error) {
      return Internal(std::string("replaying the AOTInductor CUDA graph failed: ") + error.what());
    }
    cuda_graph_replays.fetch_add(1, std::memory_order_relaxed);
    return Status::Ok();
  }
#endif

  Status ReadCudaGraph(const std::map<std::string, std::string>& metadata) {
    auto cuda_graph = metadata.find("zerokv.cuda_graph");
    if (cuda_graph == metadata.end() || cuda_graph->second == "0") return Status::Ok();
    if (cuda_graph->second != "1" || device_ != ComputeDevice::kCuda) {
      return InvalidProgram("the AOTInductor package's zerokv.cuda_graph is '" + cuda_graph->second +
                            "' for a " + (device_ == ComputeDevice::kCuda ? "CUDA" : "host") +
                            " package: expected '0', or '1' on CUDA");
    }
#ifdef ZEROKV_WITH_TORCH_CUDA
    cuda_graph_ = true;
    return ReadDependentLaunch(metadata);
#else
    return base::NotSupported(
        "the AOTInductor package asks for CUDA graphs (zerokv.cuda_graph), but this engine was built "
        "without torch's CUDA libraries");
#endif
  }

#ifdef ZEROKV_WITH_TORCH_CUDA
  // zerokv.dependent_launch_kernels: the kernels that wait for the one before them, whose edges the
  // captures make programmatic. compile_aoti names them only where it compiled them with the wait
  // (sm_90 on, where its kernels run); a device that refuses such an edge turns this off
  // (LetKernelsLaunchEarly).
  Status ReadDependentLaunch(const std::map<std::string, std::string>& metadata) {
    auto kernels = metadata.find("zerokv.dependent_launch_kernels");
    if (kernels == metadata.end()) return Status::Ok();
    for (const std::string& name : Split(kernels->second, ',')) early_kernels_.insert(name);
    return Status::Ok();
  }
#endif

  Slot* Find(const std::string& name) {
    for (Slot& slot : slots_) {
      if (slot.name == name) return &slot;
    }
    return nullptr;
  }

  at::Device TorchDevice() const {
    return device_ == ComputeDevice::kCuda
               ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index_))
               : at::Device(at::kCPU);
  }

  // Gives the package its constants: every one it has, from the blob's named data (format 3 on).
  Status LoadConstants(const blob::Blob& blob, const NamedDataMap* named_data) {
    if (blob.format_version < 3) return Status::Ok();  // the package's code holds its weights
    std::map<std::string, at::ScalarType> package;  // FQN -> dtype
    torch::inductor::AOTIModelContainerRunner* runner = loader_->get_runner();
    const auto dtypes = runner->getConstantNamesToDtypes();
    for (const auto& [name, fqn] : runner->getConstantNamesToOriginalFQNs()) {
      package.emplace(fqn, static_cast<at::ScalarType>(dtypes.at(name)));
    }
    std::set<std::string> listed;
    for (const blob::Constant& constant : blob.metadata.constants) listed.insert(constant.name);
    for (const auto& [fqn, dtype] : package) {
      if (listed.count(fqn) == 0) {
        return InvalidProgram("the AOTInductor package needs constant '" + fqn +
                              "', which the blob's constants do not list");
      }
    }
    std::unordered_map<std::string, at::Tensor> tensors;
    for (const blob::Constant& constant : blob.metadata.constants) {
      const std::string what = "constant '" + constant.name + "'";
      auto expected = package.find(constant.name);
      if (expected == package.end()) {
        return InvalidProgram("the blob lists " + what + ", which the AOTInductor package does not have");
      }
      const at::ScalarType dtype = ToTorch(constant.dtype);
      if (expected->second != dtype) {
        return InvalidProgram(what + " is " + blob::ToString(constant.dtype) + " in the blob but " +
                              c10::toString(expected->second) + " in the AOTInductor package");
      }
      std::shared_ptr<Entry> entry;
      ZEROKV_RETURN_IF_ERROR(AcquireEntry(named_data, constant.key, what, TorchDevice(), &entry));
      const size_t element_size = c10::elementSize(dtype);
      const uint64_t stored = static_cast<uint64_t>(entry->bytes.numel());
      uint64_t reached = 0;
      if (stored % element_size != 0 || !ViewBytes(constant, element_size, &reached) || reached > stored) {
        return InvalidProgram(what + ": its named data entry '" + constant.key + "' holds " +
                              std::to_string(stored) + " bytes, which its sizes, strides and offset (" +
                              blob::ToString(constant.dtype) + ") do not fit in");
      }
      tensors.emplace(constant.name, entry->bytes.view(dtype).as_strided(
                                         constant.sizes, constant.strides, constant.storage_offset));
      entries_.push_back(std::move(entry));
    }
    try {
      // User-managed: the package runs on these tensors, which this engine keeps alive.
      loader_->load_constants(tensors, /*use_inactive=*/false, /*check_full_update=*/true,
                              /*user_managed=*/true);
    } catch (const std::exception& error) {
      return InvalidProgram(std::string("the AOTInductor package refuses its constants: ") + error.what());
    }
    constants_ = std::move(tensors);
    return Status::Ok();
  }

  Status ReadBindings(const std::map<std::string, std::string>& metadata) {
    auto bindings = metadata.find("zerokv.bindings");
    auto aliases = metadata.find("zerokv.aliases");
    auto device = metadata.find("zerokv.device");
    if (bindings == metadata.end() || aliases == metadata.end() || device == metadata.end()) {
      return InvalidProgram(
          "the AOTInductor package has no zerokv binding table (zerokv.bindings, zerokv.aliases, "
          "zerokv.device): it was not compiled by zerokv's compile_aoti");
    }
    if (device->second != "cpu" && device->second != "cuda") {
      return InvalidProgram("the AOTInductor package's zerokv.device is '" + device->second + "'");
    }
    device_ = device->second == "cuda" ? ComputeDevice::kCuda : ComputeDevice::kHost;
    for (const std::string& entry : Split(bindings->second, ';')) {
      std::vector<std::string> fields = Split(entry, ':');
      Slot slot;
      if (fields.size() != 3 || fields[0].empty() || !ParseDType(fields[2], &slot.dtype) ||
          (fields[1] != "INPUT" && fields[1] != "OUTPUT")) {
        return InvalidProgram("the AOTInductor package's zerokv.bindings entry '" + entry +
                              "' is not name:INPUT|OUTPUT:DTYPE");
      }
      slot.name = fields[0];
      slot.direction = fields[1] == "INPUT" ? blob::Direction::kInput : blob::Direction::kOutput;
      bindings_.push_back({slot.name, slot.direction, slot.dtype});
      slots_.push_back(std::move(slot));
    }
    for (const std::string& entry : Split(aliases->second, ';')) {
      std::vector<std::string> fields = Split(entry, '=');
      if (fields.size() != 2 || !Find(fields[0]) || !Find(fields[1])) {
        return InvalidProgram("the AOTInductor package's zerokv.aliases entry '" + entry +
                              "' does not name an output and an input");
      }
      aliases_.emplace(fields[0], fields[1]);
    }
    return Status::Ok();
  }

  Status CopyOut(const at::Tensor& result, Slot& slot, StreamHandle stream) {
    slot.shape.assign(result.sizes().begin(), result.sizes().end());
    const size_t bytes = result.nbytes();
    if (bytes > slot.capacity) {
      return Internal("output '" + slot.name + "' has " + std::to_string(bytes) +
                      " bytes, more than the " + std::to_string(slot.capacity) + " bound");
    }
    if (bytes == 0) return Status::Ok();
    if (result.scalar_type() != ToTorch(slot.dtype)) {
      return Internal("output '" + slot.name + "' came back as " +
                      std::string(c10::toString(result.scalar_type())));
    }
    if (device_ == ComputeDevice::kHost) {
      at::from_blob(slot.data, result.sizes(), result.options()).copy_(result);
      return Status::Ok();
    }
#ifdef ZEROKV_WITH_CUDA
    // A strided copy would run on torch's current stream, not ours: compile_aoti makes outputs
    // contiguous, and anything else is refused rather than raced.
    if (!result.is_contiguous()) {
      return Internal("output '" + slot.name + "' is not contiguous");
    }
    cudaError_t error = cudaMemcpyAsync(slot.data, result.const_data_ptr(), bytes,
                                        cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
    if (error != cudaSuccess) {
      return Internal(std::string("copying output '") + slot.name + "' failed: " +
                      cudaGetErrorString(error));
    }
#else
    (void)stream;
#endif
    return Status::Ok();
  }

  ComputeDevice device_ = ComputeDevice::kHost;
  int device_index_ = -1;
  std::vector<EngineBinding> bindings_;
  std::vector<Slot> slots_;
  std::map<std::string, std::string> aliases_;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
  std::vector<std::shared_ptr<Entry>> entries_;  // what the constants view
  std::unordered_map<std::string, at::Tensor> constants_;
  std::vector<at::Tensor> outputs_;
#ifdef ZEROKV_WITH_TORCH_CUDA
  bool cuda_graph_ = false;                     // zerokv.cuda_graph: capture runs, replay them
  std::set<std::string> early_kernels_;         // zerokv.dependent_launch_kernels, where they can
  GraphKey seen_key_;                           // the binding of the last run
  std::unique_ptr<at::cuda::CUDAGraph> graph_;  // captured for graph_key_
  GraphKey graph_key_;
  struct PreparedGraph {
    std::unique_ptr<at::cuda::CUDAGraph> graph;  // captured with keep_graph into graph_'s pool
    GraphKey key;
    std::vector<std::vector<int64_t>> shapes;  // every slot's, as the capture's run left them
  };
  std::optional<PreparedGraph> prepared_;  // captured ahead (Prepare)
#endif
};

const bool registered = RegisterEngineFactory(blob::EngineKind::kAoti, CreateAotiEngine);

}  // namespace

uint64_t CudaGraphReplays() { return cuda_graph_replays.load(std::memory_order_relaxed); }

uint64_t CudaGraphUpdates() { return cuda_graph_updates.load(std::memory_order_relaxed); }

uint64_t CudaGraphsCapturedAhead() { return cuda_graphs_captured_ahead.load(std::memory_order_relaxed); }

uint64_t DependentLaunchEdges() { return dependent_launch_edges.load(std::memory_order_relaxed); }

uint64_t DependentLaunchGraphs() { return dependent_launch_graphs.load(std::memory_order_relaxed); }

Status CreateAotiEngine(const blob::Blob& blob, const NamedDataMap* named_data,
                        std::unique_ptr<Engine>* engine) {
  auto created = std::make_unique<AotiEngine>();
  ZEROKV_RETURN_IF_ERROR(created->Load(blob, named_data));
  *engine = std::move(created);
  return Status::Ok();
}

}  // namespace zerokv::engines
