#include "cc/engines/tensorrt/tensorrt_engine.h"

#include <NvInfer.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <vector>

namespace zerokv::engines {
namespace {

using runtime::Internal;
using runtime::InvalidArgument;
using runtime::InvalidProgram;

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

class TensorRtEngine final : public Engine {
 public:
  Status Load(const blob::Blob& blob) {
    if (cudaSetDevice(blob.device_id) != cudaSuccess) {
      return Internal("cannot select CUDA device " + std::to_string(blob.device_id));
    }
    runtime_.reset(nvinfer1::createInferRuntime(TheLogger()));
    if (!runtime_) return Internal("createInferRuntime failed");
    engine_.reset(runtime_->deserializeCudaEngine(blob.payload, blob.payload_size));
    if (!engine_) return InvalidProgram("the TensorRT payload does not deserialize");
    context_.reset(engine_->createExecutionContext());
    if (!context_) return Internal("createExecutionContext failed");
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

  Status SetInputShape(const std::string& name, const std::vector<int64_t>& shape) override {
    nvinfer1::Dims dims{};
    if (shape.size() > static_cast<size_t>(nvinfer1::Dims::MAX_DIMS)) {
      return InvalidArgument("input '" + name + "' has more dimensions than TensorRT allows");
    }
    dims.nbDims = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) dims.d[i] = shape[i];
    if (!context_->setInputShape(name.c_str(), dims)) {
      return InvalidArgument("TensorRT refused the shape of input '" + name + "'");
    }
    return Status::Ok();
  }

  Status SetAddress(const std::string& name, void* data, size_t) override {
    if (!context_->setTensorAddress(name.c_str(), data)) {
      return InvalidArgument("TensorRT refused the address of '" + name + "'");
    }
    return Status::Ok();
  }

  Status Enqueue(StreamHandle stream) override {
    if (!context_->enqueueV3(static_cast<cudaStream_t>(stream))) {
      return Internal("TensorRT enqueueV3 failed");
    }
    return Status::Ok();
  }

  Status OutputShape(const std::string& name, std::vector<int64_t>* shape) const override {
    nvinfer1::Dims dims = context_->getTensorShape(name.c_str());
    if (dims.nbDims < 0) return Internal("TensorRT has no shape for output '" + name + "'");
    shape->assign(dims.d, dims.d + dims.nbDims);
    return Status::Ok();
  }

 private:
  // Destroyed in reverse: the context before its engine before the runtime.
  std::unique_ptr<nvinfer1::IRuntime> runtime_;
  std::unique_ptr<nvinfer1::ICudaEngine> engine_;
  std::unique_ptr<nvinfer1::IExecutionContext> context_;
  std::vector<EngineBinding> bindings_;
};

const bool registered = RegisterEngineFactory(blob::EngineKind::kTensorrt, CreateTensorRtEngine);

}  // namespace

Status CreateTensorRtEngine(const blob::Blob& blob, std::unique_ptr<Engine>* engine) {
  auto created = std::make_unique<TensorRtEngine>();
  ZEROKV_RETURN_IF_ERROR(created->Load(blob));
  *engine = std::move(created);
  return Status::Ok();
}

}  // namespace zerokv::engines
