#include "cc/engines/tensorrt/tensorrt_engine.h"

#include <NvInfer.h>
#include <NvInferVersion.h>
#include <cuda_runtime_api.h>

// getAliasedInputTensor (the engine's own word on which output writes through which input) and the
// multi-token KV cache update that zerokv's plans use both arrived in TensorRT 10.15.
#if !defined(NV_TENSORRT_MAJOR) || !defined(NV_TENSORRT_MINOR) || NV_TENSORRT_MAJOR < 10 || \
    (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR < 15)
#error "zerokv's TensorRT adapter needs TensorRT 10.15 or newer (getAliasedInputTensor)"
#endif

#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cc/engines/tensorrt/binding_checks.h"

namespace zerokv::engines {
namespace {

using base::Internal;
using base::InvalidArgument;
using base::InvalidProgram;
using tensorrt::CheckAddressAlignment;
using tensorrt::CheckOutputFits;
using tensorrt::ProfileRanges;
using tensorrt::SelectProfile;
using tensorrt::ShapeRange;

class Logger final : public nvinfer1::ILogger {
 public:
  void log(Severity severity, const char* message) noexcept override {
    if (severity <= Severity::kWARNING) std::fprintf(stderr, "TensorRT: %s\n", message);
  }
};

Logger& TheLogger() {
  static auto* logger = new Logger();
  return *logger;
}

// Keeps the errors TensorRT reports so that the Status of the call that failed can say what
// TensorRT said. TensorRT may report from several threads (the interface requires thread safety).
class ErrorRecorder final : public nvinfer1::IErrorRecorder {
 public:
  int32_t getNbErrors() const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int32_t>(errors_.size());
  }
  nvinfer1::ErrorCode getErrorCode(int32_t index) const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return InRange(index) ? errors_[index].first : nvinfer1::ErrorCode::kINVALID_ARGUMENT;
  }
  ErrorDesc getErrorDesc(int32_t index) const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return InRange(index) ? errors_[index].second.c_str() : "no such error";
  }
  bool hasOverflowed() const noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    return dropped_ > 0;
  }
  void clear() noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    errors_.clear();
    dropped_ = 0;
  }
  bool reportError(nvinfer1::ErrorCode code, ErrorDesc description) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      if (errors_.size() < kKept) {
        errors_.emplace_back(code, description == nullptr ? "" : description);
      } else {
        ++dropped_;
      }
    } catch (...) {
      ++dropped_;  // out of memory for the message: the count still says one was lost
    }
    return true;  // every error ends the call that reported it: zerokv refuses it
  }
  RefCount incRefCount() noexcept override { return ++references_; }
  RefCount decRefCount() noexcept override { return --references_; }

  // `status` with the errors TensorRT reported since the last Clear appended, which are cleared.
  Status Annotate(Status status) {
    std::string said;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [code, description] : errors_) {
        said += (said.empty() ? "" : "; ") + description + " (error " +
                std::to_string(static_cast<int32_t>(code)) + ")";
      }
      if (dropped_ > 0) said += "; and " + std::to_string(dropped_) + " more";
      errors_.clear();
      dropped_ = 0;
    }
    if (said.empty()) return status;
    return Status(status.code(), status.message() + ": TensorRT says: " + said);
  }

 private:
  static constexpr size_t kKept = 16;
  bool InRange(int32_t index) const {
    return index >= 0 && static_cast<size_t>(index) < errors_.size();
  }

  mutable std::mutex mutex_;
  std::vector<std::pair<nvinfer1::ErrorCode, std::string>> errors_;
  size_t dropped_ = 0;
  std::atomic<RefCount> references_{0};
};

// Makes `device` the thread's current CUDA device for the scope, and gives the thread its previous
// device back after: TensorRT allocates and enqueues on the current device, whatever the caller's.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = cudaSetDevice(device);
  }
  ~ScopedDevice() {
    if (error_ == cudaSuccess && previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  Status status(int device) const {
    if (error_ == cudaSuccess) return Status::Ok();
    return Internal("cannot select CUDA device " + std::to_string(device) + ": " +
                    cudaGetErrorString(error_));
  }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

bool ToBlob(nvinfer1::DataType type, blob::DType* dtype) {
  switch (type) {
    case nvinfer1::DataType::kFLOAT:
      *dtype = blob::DType::kFloat32;
      return true;
    case nvinfer1::DataType::kHALF:
      *dtype = blob::DType::kFloat16;
      return true;
    case nvinfer1::DataType::kBF16:
      *dtype = blob::DType::kBfloat16;
      return true;
    case nvinfer1::DataType::kINT32:
      *dtype = blob::DType::kInt32;
      return true;
    case nvinfer1::DataType::kINT64:
      *dtype = blob::DType::kInt64;
      return true;
    case nvinfer1::DataType::kINT8:
      *dtype = blob::DType::kInt8;
      return true;
    case nvinfer1::DataType::kUINT8:
      *dtype = blob::DType::kUint8;
      return true;
    case nvinfer1::DataType::kBOOL:
      *dtype = blob::DType::kBool;
      return true;
    default:
      return false;
  }
}

std::vector<int64_t> ToShape(const nvinfer1::Dims& dims) {
  return std::vector<int64_t>(dims.d, dims.d + (dims.nbDims < 0 ? 0 : dims.nbDims));
}

// What the next Enqueue binds to one I/O tensor; SetInputShape and SetAddress fill it, Enqueue
// hands it to TensorRT and empties it, so that no run reuses a previous run's binding.
struct PendingBinding {
  std::optional<std::vector<int64_t>> shape;  // inputs only
  std::optional<std::pair<void*, size_t>> address;  // and the bytes bound there
};

class TensorRtEngine final : public Engine {
 public:
  ~TensorRtEngine() override {
    // TensorRT frees the context's and the engine's device memory on the device they live on.
    ScopedDevice device(device_);
    context_.reset();
    engine_.reset();
    runtime_.reset();
  }

  Status Load(const blob::Blob& blob, const NamedDataMap* named_data) {
    if (!blob.metadata.constants.empty()) {
      return InvalidProgram("the blob lists constants, which a TensorRT engine does not take (its plan "
                            "holds its weights)");
    }
    // Since format version 3 the plan is named data (it holds the weights); before, the payload.
    std::optional<FreeableBuffer> plan;
    if (!blob.metadata.engine_key.empty()) {
      ZEROKV_RETURN_IF_ERROR(GetNamedData(named_data, blob.metadata.engine_key, "the TensorRT plan", &plan));
    }
    const void* plan_data = plan ? plan->data() : blob.payload;
    const size_t plan_size = plan ? plan->size() : blob.payload_size;
    device_ = blob.device_id;
    ScopedDevice device(device_);
    ZEROKV_RETURN_IF_ERROR(device.status(device_));
    runtime_.reset(nvinfer1::createInferRuntime(TheLogger()));
    if (!runtime_) return Internal("createInferRuntime failed");
    runtime_->setErrorRecorder(&recorder_);
    // Deserialized from the mapped bytes, which can go once the engine is built.
    engine_.reset(runtime_->deserializeCudaEngine(plan_data, plan_size));
    if (!engine_) {
      return recorder_.Annotate(InvalidProgram("the TensorRT payload does not deserialize"));
    }
    engine_->setErrorRecorder(&recorder_);
    context_.reset(engine_->createExecutionContext());
    if (!context_) return recorder_.Annotate(Internal("createExecutionContext failed"));
    context_->setErrorRecorder(&recorder_);
    current_profile_ = context_->getOptimizationProfile();

    const int32_t profiles = engine_->getNbOptimizationProfiles();
    profiles_.assign(static_cast<size_t>(profiles < 0 ? 0 : profiles), ProfileRanges());
    for (int32_t i = 0; i < engine_->getNbIOTensors(); ++i) {
      const char* name = engine_->getIOTensorName(i);
      EngineBinding binding;
      binding.name = name;
      binding.direction = engine_->getTensorIOMode(name) == nvinfer1::TensorIOMode::kINPUT
                              ? blob::Direction::kInput
                              : blob::Direction::kOutput;
      if (!ToBlob(engine_->getTensorDataType(name), &binding.dtype)) {
        return InvalidProgram(std::string("TensorRT binding '") + name +
                              "' has a dtype the blob format cannot express");
      }
      ZEROKV_RETURN_IF_ERROR(CheckBindable(name, profiles));
      if (binding.direction == blob::Direction::kInput) {
        for (int32_t profile = 0; profile < profiles; ++profile) {
          ZEROKV_RETURN_IF_ERROR(ReadRange(name, profile, &profiles_[profile][name]));
        }
      }
      pending_[binding.name] = PendingBinding();
      bindings_.push_back(std::move(binding));
    }
    return Status::Ok();
  }

  ComputeDevice compute_device() const override { return ComputeDevice::kCuda; }
  const std::vector<EngineBinding>& bindings() const override { return bindings_; }

  std::optional<std::string> AliasedInput(const std::string& output) const override {
    const char* input = engine_->getAliasedInputTensor(output.c_str());
    if (input == nullptr) return std::nullopt;
    return std::string(input);
  }

  // The shape is handed to TensorRT at Enqueue, once every input's is known: it must first select
  // the optimization profile that admits them all.
  Status SetInputShape(const std::string& name, const std::vector<int64_t>& shape) override {
    const EngineBinding* binding = Find(name);
    if (binding == nullptr || binding->direction != blob::Direction::kInput) {
      return InvalidArgument("'" + name + "' is not an input of the TensorRT engine");
    }
    if (shape.size() > static_cast<size_t>(nvinfer1::Dims::MAX_DIMS)) {
      return InvalidArgument("input '" + name + "' has more dimensions than TensorRT allows");
    }
    pending_[name].shape = shape;
    return Status::Ok();
  }

  Status SetAddress(const std::string& name, void* data, size_t capacity) override {
    if (Find(name) == nullptr) {
      return InvalidArgument("'" + name + "' is not a binding of the TensorRT engine");
    }
    ZEROKV_RETURN_IF_ERROR(CheckAddressAlignment(name, data));
    pending_[name].address = std::make_pair(data, capacity);
    return Status::Ok();
  }

  Status Enqueue(StreamHandle stream) override {
    ScopedDevice device(device_);
    recorder_.clear();
    Status status = device.status(device_);
    if (status.ok()) status = Bind(static_cast<cudaStream_t>(stream));
    if (status.ok() && !context_->enqueueV3(static_cast<cudaStream_t>(stream))) {
      status = recorder_.Annotate(Internal("TensorRT enqueueV3 failed"));
    }
    for (auto& [name, pending] : pending_) pending = PendingBinding();
    return status;
  }

  Status OutputShape(const std::string& name, std::vector<int64_t>* shape) const override {
    nvinfer1::Dims dims = context_->getTensorShape(name.c_str());
    if (dims.nbDims < 0) return Internal("TensorRT has no shape for output '" + name + "'");
    *shape = ToShape(dims);
    return Status::Ok();
  }

 private:
  const EngineBinding* Find(const std::string& name) const {
    for (const EngineBinding& binding : bindings_) {
      if (binding.name == name) return &binding;
    }
    return nullptr;
  }

  // zerokv binds device buffers in the layout ExecuTorch and the KV caches have: dense, row-major.
  Status CheckBindable(const char* name, int32_t profiles) const {
    if (engine_->getTensorLocation(name) != nvinfer1::TensorLocation::kDEVICE) {
      return InvalidProgram(std::string("TensorRT binding '") + name +
                            "' is host-resident; zerokv binds device memory only");
    }
    if (engine_->isShapeInferenceIO(name)) {
      return InvalidProgram(std::string("TensorRT binding '") + name +
                            "' is a shape tensor (read on the host); zerokv binds device memory");
    }
    for (int32_t profile = 0; profile < profiles; ++profile) {
      if (engine_->getTensorFormat(name, profile) != nvinfer1::TensorFormat::kLINEAR) {
        const char* format = engine_->getTensorFormatDesc(name, profile);
        return InvalidProgram(std::string("TensorRT binding '") + name + "' has format '" +
                              (format == nullptr ? "?" : format) + "' in profile " +
                              std::to_string(profile) +
                              "; zerokv binds linear (row-major) tensors only");
      }
    }
    return Status::Ok();
  }

  Status ReadRange(const char* name, int32_t profile, ShapeRange* range) const {
    using nvinfer1::OptProfileSelector;
    nvinfer1::Dims min = engine_->getProfileShape(name, profile, OptProfileSelector::kMIN);
    nvinfer1::Dims max = engine_->getProfileShape(name, profile, OptProfileSelector::kMAX);
    if (min.nbDims < 0 || max.nbDims < 0) {
      // A static input has no range of its own in a profile: it admits its one shape.
      min = max = engine_->getTensorShape(name);
      for (int32_t axis = 0; axis < min.nbDims; ++axis) {
        if (min.d[axis] < 0) {
          return InvalidProgram(std::string("TensorRT input '") + name +
                                "' is dynamic but profile " + std::to_string(profile) +
                                " gives it no range");
        }
      }
    }
    range->min = ToShape(min);
    range->max = ToShape(max);
    return Status::Ok();
  }

  // Selects the profile, then hands TensorRT the shapes and addresses, and checks each output
  // against the buffer bound to it. On the engine's device.
  Status Bind(cudaStream_t stream) {
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& [name, pending] : pending_) {
      if (pending.shape) shapes[name] = *pending.shape;
    }
    int profile = current_profile_;
    ZEROKV_RETURN_IF_ERROR(SelectProfile(profiles_, shapes, current_profile_, &profile));
    if (profile != current_profile_) {
      if (!context_->setOptimizationProfileAsync(profile, stream)) {
        return recorder_.Annotate(
            Internal("TensorRT cannot switch to optimization profile " + std::to_string(profile)));
      }
      current_profile_ = profile;
    }
    for (const auto& [name, shape] : shapes) {
      nvinfer1::Dims dims{};
      dims.nbDims = static_cast<int32_t>(shape.size());
      for (size_t i = 0; i < shape.size(); ++i) dims.d[i] = shape[i];
      if (!context_->setInputShape(name.c_str(), dims)) {
        return recorder_.Annotate(
            InvalidArgument("TensorRT refused the shape of input '" + name + "'"));
      }
    }
    for (const EngineBinding& binding : bindings_) {
      const PendingBinding& pending = pending_.at(binding.name);
      if (!pending.address) {
        return InvalidArgument("binding '" + binding.name + "' has no address for this run");
      }
      if (!context_->setTensorAddress(binding.name.c_str(), pending.address->first)) {
        return recorder_.Annotate(
            InvalidArgument("TensorRT refused the address of '" + binding.name + "'"));
      }
      if (binding.direction != blob::Direction::kOutput) continue;
      const std::vector<int64_t> shape = ToShape(context_->getTensorShape(binding.name.c_str()));
      ZEROKV_RETURN_IF_ERROR(CheckOutputFits(binding.name, shape, blob::ElementBytes(binding.dtype),
                                             pending.address->second));
    }
    return Status::Ok();
  }

  int device_ = 0;
  // Declared before the TensorRT objects it is set on, so that it outlives them.
  ErrorRecorder recorder_;
  // Destroyed in reverse: the context before its engine before the runtime.
  std::unique_ptr<nvinfer1::IRuntime> runtime_;
  std::unique_ptr<nvinfer1::ICudaEngine> engine_;
  std::unique_ptr<nvinfer1::IExecutionContext> context_;
  std::vector<EngineBinding> bindings_;
  std::map<std::string, PendingBinding> pending_;
  std::vector<ProfileRanges> profiles_;  // per profile: each input's admitted shapes
  int current_profile_ = 0;
};

const bool registered = RegisterEngineFactory(blob::EngineKind::kTensorrt, CreateTensorRtEngine);

}  // namespace

Status CreateTensorRtEngine(const blob::Blob& blob, const NamedDataMap* named_data,
                            std::unique_ptr<Engine>* engine) {
  auto created = std::make_unique<TensorRtEngine>();
  ZEROKV_RETURN_IF_ERROR(created->Load(blob, named_data));
  *engine = std::move(created);
  return Status::Ok();
}

}  // namespace zerokv::engines
