#include "cc/engines/megakernel/megakernel_engine.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "cc/engines/megakernel/llama_decode_step.h"

namespace zerokv::engines::megakernel {
namespace {

using base::Internal;
using base::InvalidArgument;
using base::InvalidProgram;
using blob::DType;
using blob::Direction;

std::string Quote(const std::string& s) { return "'" + s + "'"; }

Status CudaError(const std::string& what, cudaError_t error) {
  return Internal(what + ": " + cudaGetErrorString(error));
}

struct Settings {
  float rms_eps = 0.f;
  float rope_attention_scaling = 0.f;
};

// The payload's "name value" lines: each setting exactly once, nothing else.
Status ParseSettings(const blob::Blob& blob, Settings* settings) {
  const std::string text(reinterpret_cast<const char*>(blob.payload), blob.payload_size);
  std::map<std::string, float*> wanted = {{"rms_eps", &settings->rms_eps},
                                          {"rope_attention_scaling", &settings->rope_attention_scaling}};
  std::map<std::string, bool> seen;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    const std::string name = line.substr(0, space);
    auto setting = wanted.find(name);
    if (setting == wanted.end() || space == std::string::npos) {
      return InvalidProgram("megakernel payload: " + Quote(line) + " is not a setting (rms_eps or " +
                            "rope_attention_scaling, then a space and its value)");
    }
    if (seen[name]) return InvalidProgram("megakernel payload: " + name + " is set twice");
    seen[name] = true;
    const std::string value = line.substr(space + 1);
    char* end = nullptr;
    errno = 0;
    const float parsed = std::strtof(value.c_str(), &end);
    if (value.empty() || *end != '\0' || errno != 0 || !std::isfinite(parsed) || parsed <= 0.f) {
      return InvalidProgram("megakernel payload: " + name + " is " + Quote(value) +
                            ", not a finite positive number");
    }
    *setting->second = parsed;
  }
  for (const auto& [name, value] : wanted) {
    if (!seen[name]) return InvalidProgram("megakernel payload: " + name + " is not set");
  }
  return Status::Ok();
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// The constants by name, each whole and contiguous, of `dtype`.
class Constants {
 public:
  explicit Constants(const blob::Metadata& metadata) {
    for (const blob::Constant& constant : metadata.constants) by_name_[constant.name] = &constant;
  }

  bool Has(const std::string& name) const { return by_name_.count(name) != 0; }

  Status Get(const std::string& name, DType dtype, size_t rank, const blob::Constant** constant) {
    auto found = by_name_.find(name);
    if (found == by_name_.end()) return InvalidProgram("megakernel constant " + Quote(name) + " is missing");
    const blob::Constant& c = *found->second;
    if (c.dtype != dtype) {
      return InvalidProgram("megakernel constant " + Quote(name) + " is " + ToString(c.dtype) + ", not " +
                            ToString(dtype));
    }
    if (c.sizes.size() != rank) {
      return InvalidProgram("megakernel constant " + Quote(name) + " has shape " + ShapeText(c.sizes) + ", not " +
                            std::to_string(rank) + " dimensions");
    }
    int64_t stride = 1;
    for (size_t d = rank; d-- > 0;) {
      if (c.strides[d] != stride && c.sizes[d] != 1) {
        return InvalidProgram("megakernel constant " + Quote(name) + " is not contiguous (strides " +
                              ShapeText(c.strides) + " for shape " + ShapeText(c.sizes) + ")");
      }
      stride *= c.sizes[d];
    }
    if (c.storage_offset != 0) {
      return InvalidProgram("megakernel constant " + Quote(name) + " starts " + std::to_string(c.storage_offset) +
                            " elements into its entry; the step reads whole entries");
    }
    used_.push_back(name);
    *constant = &c;
    return Status::Ok();
  }

  // A constant the step does not read is a blob for another engine: refused rather than ignored.
  Status CheckAllUsed() const {
    for (const auto& [name, constant] : by_name_) {
      if (std::find(used_.begin(), used_.end(), name) == used_.end()) {
        return InvalidProgram("megakernel constant " + Quote(name) + " is not one the step reads");
      }
    }
    return Status::Ok();
  }

 private:
  std::map<std::string, const blob::Constant*> by_name_;
  std::vector<std::string> used_;
};

Status Expect(const blob::Constant& c, const std::vector<int64_t>& shape) {
  if (c.sizes != shape) {
    return InvalidProgram("megakernel constant " + Quote(c.name) + " has shape " + ShapeText(c.sizes) + ", not " +
                          ShapeText(shape));
  }
  return Status::Ok();
}

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct HostFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};

constexpr int kPerLayer = 7;
const char* const kLayerWeights[kPerLayer] = {"input_norm", "qkv", "o", "post_norm", "gate", "up", "down"};

class MegakernelEngine final : public Engine {
 public:
  Status Load(const blob::Blob& blob, const NamedDataMap* named_data) {
    Settings settings;
    ZEROKV_RETURN_IF_ERROR(ParseSettings(blob, &settings));
    Constants constants(blob.metadata);
    Roles roles;
    ZEROKV_RETURN_IF_ERROR(ReadShape(constants, settings, &roles));
    ZEROKV_RETURN_IF_ERROR(constants.CheckAllUsed());
    ZEROKV_RETURN_IF_ERROR(MakeBindings(blob.metadata));
    if (cudaError_t e = cudaSetDevice(blob.device_id); e != cudaSuccess) {
      return CudaError("megakernel: selecting CUDA device " + std::to_string(blob.device_id), e);
    }
    ZEROKV_RETURN_IF_ERROR(Upload(roles, named_data));

    void* workspace = nullptr;
    const size_t workspace_bytes = LlamaDecodeWorkspaceBytes(args_.shape);
    if (cudaError_t e = cudaMalloc(&workspace, workspace_bytes); e != cudaSuccess) {
      return CudaError("megakernel: allocating the " + std::to_string(workspace_bytes) + "-byte workspace", e);
    }
    workspace_.reset(workspace);
    if (cudaError_t e = cudaMemset(workspace, 0, workspace_bytes); e != cudaSuccess) {
      return CudaError("megakernel: zeroing the workspace", e);
    }
    void* error = nullptr;
    if (cudaError_t e = cudaHostAlloc(&error, sizeof(uint32_t), cudaHostAllocMapped); e != cudaSuccess) {
      return CudaError("megakernel: allocating the step's mapped error word", e);
    }
    error_.reset(error);
    *static_cast<volatile uint32_t*>(error) = 0;
    if (cudaError_t e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&args_.error), error, 0);
        e != cudaSuccess) {
      return CudaError("megakernel: mapping the step's error word", e);
    }
    args_.workspace = workspace;
    return Status::Ok();
  }

  ComputeDevice compute_device() const override { return ComputeDevice::kCuda; }
  const std::vector<EngineBinding>& bindings() const override { return bindings_; }

  std::optional<std::string> AliasedInput(const std::string& output) const override {
    const int index = Find(output);
    if (index < 0 || slots_[index].aliased_input < 0) return std::nullopt;
    return bindings_[slots_[index].aliased_input].name;
  }

  Status SetInputShape(const std::string& name, const std::vector<int64_t>& shape) override {
    const int index = Find(name);
    if (index < 0 || bindings_[index].direction != Direction::kInput) {
      return InvalidArgument("megakernel: " + Quote(name) + " is not an input of the step");
    }
    Slot& slot = slots_[index];
    if (slot.cache) {
      const LlamaShape& s = args_.shape;
      if (shape.size() != 4 || shape[0] != 1 || shape[1] != s.kv_heads || shape[2] < 1 ||
          shape[2] > std::numeric_limits<int32_t>::max() || shape[3] != s.head_dim) {
        return InvalidArgument("megakernel: " + Quote(name) + " has shape " + ShapeText(shape) + ", not [1, " +
                               std::to_string(s.kv_heads) + ", capacity, " + std::to_string(s.head_dim) + "]");
      }
    } else {
      int64_t elements = 1;
      for (int64_t extent : shape) elements *= extent;
      if (elements != 1) {
        return InvalidArgument("megakernel: " + Quote(name) + " has shape " + ShapeText(shape) +
                               "; the step takes one token at one position");
      }
    }
    slot.shape = shape;
    return Status::Ok();
  }

  Status SetAddress(const std::string& name, void* data, size_t capacity) override {
    const int index = Find(name);
    if (index < 0) return InvalidArgument("megakernel: " + Quote(name) + " is not a binding of the step");
    slots_[index].data = data;
    slots_[index].capacity = capacity;
    return Status::Ok();
  }

  Status Enqueue(StreamHandle stream) override {
    if (const uint32_t refused = *static_cast<volatile uint32_t*>(error_.get()); refused != 0) {
      *static_cast<volatile uint32_t*>(error_.get()) = 0;
      return InvalidArgument(refused == kBadPosition
                                 ? "megakernel: an earlier step's position was outside its KV caches' capacity: "
                                   "it wrote nothing and its logits were NaN"
                                 : "megakernel: an earlier step's token was outside the vocabulary of " +
                                       std::to_string(args_.shape.vocab) + ": it wrote nothing and its logits were NaN");
    }
    LlamaShape& s = args_.shape;
    s.capacity = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& slot = slots_[i];
      const std::string& name = bindings_[i].name;
      if (slot.data == nullptr) return InvalidArgument("megakernel: " + Quote(name) + " is not bound");
      if (slot.aliased_input >= 0) {
        if (slot.data != slots_[slot.aliased_input].data) {
          return InvalidArgument("megakernel: " + Quote(name) + " is not bound to its input " +
                                 Quote(bindings_[slot.aliased_input].name) + "'s buffer");
        }
        continue;
      }
      if (bindings_[i].direction == Direction::kInput && slot.shape.empty() && slot.cache) {
        return InvalidArgument("megakernel: " + Quote(name) + " has no shape");
      }
      if (slot.cache) {
        if (s.capacity != 0 && slot.shape[2] != s.capacity) {
          return InvalidArgument("megakernel: " + Quote(name) + " holds " + std::to_string(slot.shape[2]) +
                                 " positions, the caches before it " + std::to_string(s.capacity));
        }
        s.capacity = static_cast<int>(slot.shape[2]);
      }
    }
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& slot = slots_[i];
      const size_t elements = slot.cache                ? static_cast<size_t>(s.kv_heads) * s.capacity * s.head_dim
                              : i + 1 == slots_.size() ? static_cast<size_t>(s.vocab)
                                                       : 1;
      const size_t needed = elements * blob::ElementBytes(bindings_[i].dtype);
      if (slot.aliased_input < 0 && slot.capacity < needed) {
        return InvalidArgument("megakernel: " + Quote(bindings_[i].name) + " is bound to " +
                               std::to_string(slot.capacity) + " bytes, fewer than its " + std::to_string(needed));
      }
    }
    args_.token = static_cast<const int64_t*>(slots_[kToken].data);
    args_.position = static_cast<const int64_t*>(slots_[kPosition].data);
    for (int l = 0; l < s.layers; ++l) {
      args_.layer[l].k_cache = static_cast<__nv_bfloat16*>(slots_[kFirstCache + 2 * l].data);
      args_.layer[l].v_cache = static_cast<__nv_bfloat16*>(slots_[kFirstCache + 2 * l + 1].data);
    }
    args_.logits = static_cast<__nv_bfloat16*>(slots_.back().data);
    std::string why;
    if (cudaError_t e = LaunchLlamaDecodeStep(args_, static_cast<cudaStream_t>(stream), &why); e != cudaSuccess) {
      return Internal("megakernel: " + why);
    }
    return Status::Ok();
  }

  Status OutputShape(const std::string& name, std::vector<int64_t>* shape) const override {
    const int index = Find(name);
    if (index < 0 || bindings_[index].direction != Direction::kOutput) {
      return InvalidArgument("megakernel: " + Quote(name) + " is not an output of the step");
    }
    const Slot& slot = slots_[index];
    *shape = slot.aliased_input >= 0 ? slots_[slot.aliased_input].shape
                                     : std::vector<int64_t>{1, 1, args_.shape.vocab};
    return Status::Ok();
  }

 private:
  static constexpr int kToken = 0;
  static constexpr int kPosition = 1;
  static constexpr int kFirstCache = 2;

  // The constants by their part in the step: views into the blob's metadata, used during Load.
  struct Roles {
    const blob::Constant* embedding = nullptr;
    const blob::Constant* lm_head = nullptr;
    const blob::Constant* final_norm = nullptr;
    const blob::Constant* inv_freq = nullptr;
    std::vector<std::vector<const blob::Constant*>> layers;  // kLayerWeights' order
  };

  struct Slot {
    bool cache = false;
    int aliased_input = -1;
    std::vector<int64_t> shape;
    void* data = nullptr;
    size_t capacity = 0;
  };

  Status ReadShape(Constants& constants, const Settings& settings, Roles* out) {
    Roles& roles = *out;
    LlamaShape& s = args_.shape;
    ZEROKV_RETURN_IF_ERROR(constants.Get("embedding", DType::kBfloat16, 2, &roles.embedding));
    ZEROKV_RETURN_IF_ERROR(constants.Get("lm_head", DType::kBfloat16, 2, &roles.lm_head));
    ZEROKV_RETURN_IF_ERROR(constants.Get("final_norm", DType::kBfloat16, 1, &roles.final_norm));
    ZEROKV_RETURN_IF_ERROR(constants.Get("inv_freq", DType::kFloat32, 1, &roles.inv_freq));
    s.vocab = static_cast<int>(roles.embedding->sizes[0]);
    s.hidden = static_cast<int>(roles.embedding->sizes[1]);
    s.head_dim = static_cast<int>(2 * roles.inv_freq->sizes[0]);
    ZEROKV_RETURN_IF_ERROR(Expect(*roles.lm_head, {s.vocab, s.hidden}));
    ZEROKV_RETURN_IF_ERROR(Expect(*roles.final_norm, {s.hidden}));
    while (roles.layers.size() <= static_cast<size_t>(kMaxLayers)) {
      const std::string prefix = "layers." + std::to_string(roles.layers.size()) + ".";
      if (!constants.Has(prefix + kLayerWeights[0])) break;
      std::vector<const blob::Constant*> layer;
      for (int w = 0; w < kPerLayer; ++w) {
        const blob::Constant* c = nullptr;
        const size_t rank = w == 0 || w == 3 ? 1 : 2;
        ZEROKV_RETURN_IF_ERROR(constants.Get(prefix + kLayerWeights[w], DType::kBfloat16, rank, &c));
        layer.push_back(c);
      }
      roles.layers.push_back(std::move(layer));
    }
    s.layers = static_cast<int>(roles.layers.size());
    if (s.layers == 0) return InvalidProgram("megakernel constant 'layers.0.input_norm' is missing");
    const auto& first = roles.layers[0];
    s.ffn = static_cast<int>(first[4]->sizes[0]);
    const int64_t attention_width = first[2]->sizes[1];
    if (s.head_dim <= 0 || attention_width % s.head_dim != 0 || first[1]->sizes[0] % s.head_dim != 0) {
      return InvalidProgram("megakernel: inv_freq's " + std::to_string(s.head_dim / 2) +
                            " frequencies do not divide the attention's " + std::to_string(attention_width) +
                            " columns and qkv's " + std::to_string(first[1]->sizes[0]) + " rows into heads");
    }
    s.heads = static_cast<int>(attention_width / s.head_dim);
    s.kv_heads = static_cast<int>((first[1]->sizes[0] / s.head_dim - s.heads) / 2);
    const int qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim;
    for (const auto& layer : roles.layers) {
      ZEROKV_RETURN_IF_ERROR(Expect(*layer[0], {s.hidden}));
      ZEROKV_RETURN_IF_ERROR(Expect(*layer[1], {qkv_rows, s.hidden}));
      ZEROKV_RETURN_IF_ERROR(Expect(*layer[2], {s.hidden, attention_width}));
      ZEROKV_RETURN_IF_ERROR(Expect(*layer[3], {s.hidden}));
      ZEROKV_RETURN_IF_ERROR(Expect(*layer[4], {s.ffn, s.hidden}));
      ZEROKV_RETURN_IF_ERROR(Expect(*layer[5], {s.ffn, s.hidden}));
      ZEROKV_RETURN_IF_ERROR(Expect(*layer[6], {s.hidden, s.ffn}));
    }
    s.capacity = 1;  // the caches' binding decides it at each step
    s.rms_eps = settings.rms_eps;
    args_.rope_attention_scaling = settings.rope_attention_scaling;
    if (std::string why = UnsupportedShape(s); !why.empty()) {
      return base::NotSupported("megakernel: the step cannot run this model: " + why);
    }
    return Status::Ok();
  }

  // Each named data entry once on the device, whatever the constants that read it.
  Status Upload(const Roles& roles, const NamedDataMap* named_data) {
    std::map<std::string, void*> by_key;
    auto device_copy = [&](const blob::Constant& c, const void** out) -> Status {
      if (auto found = by_key.find(c.key); found != by_key.end()) {
        *out = found->second;
        return Status::Ok();
      }
      size_t bytes = blob::ElementBytes(c.dtype);
      for (int64_t extent : c.sizes) bytes *= static_cast<size_t>(extent);
      std::optional<FreeableBuffer> host;
      ZEROKV_RETURN_IF_ERROR(GetNamedData(named_data, c.key, "megakernel constant " + Quote(c.name), &host));
      if (host->size() < bytes) {
        return InvalidProgram("megakernel constant " + Quote(c.name) + " needs " + std::to_string(bytes) +
                              " bytes; its named data entry " + Quote(c.key) + " holds " +
                              std::to_string(host->size()));
      }
      void* device = nullptr;
      if (cudaError_t e = cudaMalloc(&device, bytes); e != cudaSuccess) {
        return CudaError("megakernel: allocating " + std::to_string(bytes) + " bytes for " + Quote(c.name), e);
      }
      weights_.emplace_back(device);
      if (cudaError_t e = cudaMemcpy(device, host->data(), bytes, cudaMemcpyHostToDevice); e != cudaSuccess) {
        return CudaError("megakernel: copying " + Quote(c.name) + " to the device", e);
      }
      by_key[c.key] = device;
      *out = device;
      return Status::Ok();
    };
    auto bf16 = [&](const blob::Constant& c, const __nv_bfloat16** out) -> Status {
      const void* p = nullptr;
      ZEROKV_RETURN_IF_ERROR(device_copy(c, &p));
      *out = static_cast<const __nv_bfloat16*>(p);
      return Status::Ok();
    };
    for (size_t l = 0; l < roles.layers.size(); ++l) {
      const auto& w = roles.layers[l];
      LlamaLayer& layer = args_.layer[l];
      ZEROKV_RETURN_IF_ERROR(bf16(*w[0], &layer.input_norm));
      ZEROKV_RETURN_IF_ERROR(bf16(*w[1], &layer.qkv));
      ZEROKV_RETURN_IF_ERROR(bf16(*w[2], &layer.o));
      ZEROKV_RETURN_IF_ERROR(bf16(*w[3], &layer.post_norm));
      ZEROKV_RETURN_IF_ERROR(bf16(*w[4], &layer.gate));
      ZEROKV_RETURN_IF_ERROR(bf16(*w[5], &layer.up));
      ZEROKV_RETURN_IF_ERROR(bf16(*w[6], &layer.down));
    }
    ZEROKV_RETURN_IF_ERROR(bf16(*roles.embedding, &args_.embedding));
    ZEROKV_RETURN_IF_ERROR(bf16(*roles.final_norm, &args_.final_norm));
    ZEROKV_RETURN_IF_ERROR(bf16(*roles.lm_head, &args_.lm_head));
    const void* inv_freq = nullptr;
    ZEROKV_RETURN_IF_ERROR(device_copy(*roles.inv_freq, &inv_freq));
    args_.inv_freq = static_cast<const float*>(inv_freq);
    return Status::Ok();
  }

  // The step's bindings, named as the blob names them (an export names them after the program's
  // inputs), each in its place: token, position, K and V of each layer; their writes; the logits.
  Status MakeBindings(const blob::Metadata& metadata) {
    const int layers = args_.shape.layers;
    const size_t count = 2 + 4 * static_cast<size_t>(layers) + 1;
    if (metadata.bindings.size() != count) {
      return InvalidProgram("megakernel: the blob has " + std::to_string(metadata.bindings.size()) +
                            " bindings; the step of " + std::to_string(layers) + " layers has " + std::to_string(count));
    }
    auto add = [&](const std::string& role, Direction direction, DType dtype, bool cache, int aliased_input) {
      const size_t index = bindings_.size();
      const blob::IOBinding& got = metadata.bindings[index];
      if (got.direction != direction || got.dtype != dtype) {
        return InvalidProgram("megakernel: binding " + std::to_string(index) + " " + Quote(got.name) + " is (" +
                              ToString(got.direction) + ", " + ToString(got.dtype) + "); the step's " + role +
                              " is (" + ToString(direction) + ", " + ToString(dtype) + ")");
      }
      bindings_.push_back({got.name, direction, dtype});
      slots_.push_back({cache, aliased_input, {}, nullptr, 0});
      return Status::Ok();
    };
    ZEROKV_RETURN_IF_ERROR(add("token", Direction::kInput, DType::kInt64, false, -1));
    ZEROKV_RETURN_IF_ERROR(add("position", Direction::kInput, DType::kInt64, false, -1));
    for (int l = 0; l < layers; ++l) {
      for (const char* kind : {"K", "V"}) {
        ZEROKV_RETURN_IF_ERROR(
            add("layer " + std::to_string(l) + " " + kind + " cache", Direction::kInput, DType::kBfloat16, true, -1));
      }
    }
    for (int c = 0; c < 2 * layers; ++c) {
      ZEROKV_RETURN_IF_ERROR(add("layer " + std::to_string(c / 2) + (c % 2 ? " V" : " K") + " cache's write",
                                 Direction::kOutput, DType::kBfloat16, true, kFirstCache + c));
    }
    ZEROKV_RETURN_IF_ERROR(add("logits", Direction::kOutput, DType::kBfloat16, false, -1));
    std::map<std::string, int> seen;
    for (size_t i = 0; i < bindings_.size(); ++i) {
      if (!seen.emplace(bindings_[i].name, static_cast<int>(i)).second) {
        return InvalidProgram("megakernel: bindings " + std::to_string(seen[bindings_[i].name]) + " and " +
                              std::to_string(i) + " are both named " + Quote(bindings_[i].name));
      }
    }
    return Status::Ok();
  }

  int Find(const std::string& name) const {
    for (size_t i = 0; i < bindings_.size(); ++i) {
      if (bindings_[i].name == name) return static_cast<int>(i);
    }
    return -1;
  }

  LlamaDecodeArgs args_{};
  std::vector<std::unique_ptr<void, DeviceFree>> weights_;
  std::unique_ptr<void, DeviceFree> workspace_;
  std::unique_ptr<void, HostFree> error_;
  std::vector<EngineBinding> bindings_;
  std::vector<Slot> slots_;
};

}  // namespace

Status CreateMegakernelEngine(const blob::Blob& blob, const NamedDataMap* named_data,
                              std::unique_ptr<Engine>* engine) {
  auto created = std::make_unique<MegakernelEngine>();
  ZEROKV_RETURN_IF_ERROR(created->Load(blob, named_data));
  *engine = std::move(created);
  return Status::Ok();
}

namespace {
const bool registered = RegisterEngineFactory(blob::EngineKind::kMegakernel, CreateMegakernelEngine);
}  // namespace

}  // namespace zerokv::engines::megakernel
