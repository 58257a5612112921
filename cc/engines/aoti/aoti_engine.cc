#include "cc/engines/aoti/aoti_engine.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#ifdef ZEROKV_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace zerokv::engines {
namespace {

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

// Writes the payload where AOTIModelPackageLoader can open it (it takes a path) and removes it
// once loaded: the loader extracts what it needs into a directory of its own.
class PayloadFile {
 public:
  Status Write(const uint8_t* data, size_t size) {
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/zerokv_aoti_XXXXXX.pt2";
    int fd = mkstemps(path_.data(), 4);
    if (fd < 0) return Internal("cannot create a temporary file for the AOTInductor package");
    size_t written = 0;
    while (written < size) {
      ssize_t n = ::write(fd, data + written, size - written);
      if (n <= 0) {
        ::close(fd);
        return Internal("cannot write the AOTInductor package to " + path_);
      }
      written += static_cast<size_t>(n);
    }
    ::close(fd);
    return Status::Ok();
  }
  const std::string& path() const { return path_; }
  ~PayloadFile() {
    if (!path_.empty()) std::remove(path_.c_str());
  }

 private:
  std::string path_;
};

class AotiEngine final : public Engine {
 public:
  Status Load(const blob::Blob& blob) {
    PayloadFile file;
    ZEROKV_RETURN_IF_ERROR(file.Write(blob.payload, blob.payload_size));
#ifdef ZEROKV_WITH_CUDA
    // A CUDA package loads onto the current device. Which kind the package is, its metadata says
    // only once it is loaded; a host package needs no device, so a machine without a GPU (where
    // this fails) still loads those, and a CUDA package reports the failure below.
    const cudaError_t selected = cudaSetDevice(blob.device_id);
    if (selected != cudaSuccess) cudaGetLastError();  // for a host package, no error: cleared
#endif
    try {
      loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(file.path(), "model");
    } catch (const std::exception& error) {
      return InvalidProgram(std::string("the AOTInductor payload does not load: ") + error.what());
    }
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
    return Status::Ok();
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
    const at::Device device = device_ == ComputeDevice::kCuda
                                  ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index_))
                                  : at::Device(at::kCPU);
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

  Slot* Find(const std::string& name) {
    for (Slot& slot : slots_) {
      if (slot.name == name) return &slot;
    }
    return nullptr;
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
  std::vector<at::Tensor> outputs_;
};

const bool registered = RegisterEngineFactory(blob::EngineKind::kAoti, CreateAotiEngine);

}  // namespace

Status CreateAotiEngine(const blob::Blob& blob, std::unique_ptr<Engine>* engine) {
  auto created = std::make_unique<AotiEngine>();
  ZEROKV_RETURN_IF_ERROR(created->Load(blob));
  *engine = std::move(created);
  return Status::Ok();
}

}  // namespace zerokv::engines
