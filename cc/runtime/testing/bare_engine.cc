#include "cc/runtime/testing/bare_engine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

namespace zerokv::testing {
namespace {

void CudaOk(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "bare engine: %s: %s\n", what.c_str(), cudaGetErrorString(error));
  std::exit(1);
}

}  // namespace

BareEngine::BareEngine(const std::string& blob_path, const std::string& data_path) : path_(blob_path) {
  std::ifstream file(blob_path, std::ios::binary);
  bytes_.assign(std::istreambuf_iterator<char>(file), {});
  if (!file || blob::Parse(bytes_.data(), bytes_.size(), &blob_)) {
    std::fprintf(stderr, "%s: not a readable zerokv blob\n", blob_path.c_str());
    std::exit(1);
  }
  auto loader = executorch::extension::MmapDataLoader::from(data_path.c_str());
  if (!loader.ok()) {
    std::fprintf(stderr, "%s: cannot be mapped\n", data_path.c_str());
    std::exit(1);
  }
  loader_.emplace(std::move(*loader));
  auto named_data = executorch::extension::FlatTensorDataMap::load(&*loader_);
  if (!named_data.ok()) {
    std::fprintf(stderr, "%s: not a .ptd\n", data_path.c_str());
    std::exit(1);
  }
  named_data_.emplace(std::move(*named_data));
  Require(engines::CreateEngine(blob_, &*named_data_, &engine_), "engine");
  std::map<std::string, std::string> aliased;
  for (const auto& alias : blob_.metadata.aliased_io) aliased[alias.output] = alias.input;
  CudaOk(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a stream");
  for (const auto& binding : blob_.metadata.bindings) {
    std::vector<int64_t> shape;
    size_t bytes = blob::ElementBytes(binding.dtype);
    for (const auto& dim : binding.shape) {
      shape.push_back(dim.max);
      bytes *= dim.max;
    }
    void* data = nullptr;
    if (aliased.count(binding.name)) {
      data = address_.at(aliased[binding.name]);
    } else {
      CudaOk(cudaMalloc(&data, std::max<size_t>(bytes, 1)), "allocating " + binding.name);
      CudaOk(cudaMemset(data, 0, std::max<size_t>(bytes, 1)), "clearing " + binding.name);
      owned_.push_back(data);
    }
    address_[binding.name] = data;
    if (binding.direction == blob::Direction::kInput && binding.dtype == blob::DType::kInt64) {
      host_inputs_.push_back({data, static_cast<int64_t*>(HostBuffer(sizeof(int64_t), binding.name)),
                              binding.name.find("position") != std::string::npos});
    } else if (binding.direction == blob::Direction::kOutput && !aliased.count(binding.name)) {
      host_outputs_.push_back({binding.name, data, blob::ElementBytes(binding.dtype), HostBuffer(bytes, binding.name), bytes});
    }
    if (binding.direction == blob::Direction::kInput) {
      Require(engine_->SetInputShape(binding.name, shape), binding.name);
    }
    Require(engine_->SetAddress(binding.name, data, bytes), binding.name);
  }
}

BareEngine::~BareEngine() {
  for (void* data : owned_) cudaFree(data);
  for (void* data : owned_host_) cudaFreeHost(data);
  cudaStreamDestroy(stream_);
}

void BareEngine::SetPosition(int64_t position) {
  for (const auto& binding : blob_.metadata.bindings) {
    if (binding.direction == blob::Direction::kInput && binding.dtype == blob::DType::kInt64 &&
        binding.name.find("position") != std::string::npos) {
      CudaOk(cudaMemcpy(address_.at(binding.name), &position, sizeof(position), cudaMemcpyHostToDevice),
             "writing " + binding.name);
    }
  }
}

void BareEngine::Step() {
  Require(engine_->Enqueue(stream_), "Enqueue");
  CudaOk(cudaStreamSynchronize(stream_), "synchronizing");
}

void* BareEngine::HostBuffer(size_t bytes, const std::string& name) {
  void* data = nullptr;
  CudaOk(cudaMallocHost(&data, std::max<size_t>(bytes, 1)), "allocating the host's " + name);
  owned_host_.push_back(data);
  return data;
}

void BareEngine::StepWithHostIO(int64_t token, int64_t position) {
  // Each host buffer is free again at the step's end, which finishes the stream.
  for (const HostInput& input : host_inputs_) {
    *input.host = input.is_position ? position : token;
    CudaOk(cudaMemcpyAsync(input.device, input.host, sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
           "writing an input");
  }
  Require(engine_->Enqueue(stream_), "Enqueue");
  for (HostOutput& output : host_outputs_) {
    std::vector<int64_t> shape;
    Require(engine_->OutputShape(output.name, &shape), output.name);
    size_t bytes = output.element_bytes;
    for (int64_t extent : shape) bytes *= static_cast<size_t>(extent);
    CudaOk(cudaMemcpyAsync(output.host, output.device, std::min(bytes, output.host_bytes),
                           cudaMemcpyDeviceToHost, stream_),
           "reading " + output.name);
  }
  CudaOk(cudaStreamSynchronize(stream_), "synchronizing");
}

void BareEngine::Require(const base::Status& status, const std::string& what) const {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: bare engine: %s: %s\n", path_.c_str(), what.c_str(), status.message().c_str());
  std::exit(1);
}

}  // namespace zerokv::testing
