// A MEGAKERNEL blob of a small Llama shape, for the engine's tests: its constants and bindings as
// megakernel_engine.h lays them out, the payload's settings, and Refusal() for what CreateEngine
// says of it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cc/engines/megakernel/megakernel_engine.h"
#include "gtest/gtest.h"

namespace zerokv::engines::megakernel::testing {

using blob::Constant;
using blob::DType;
using blob::IOBinding;

inline constexpr int kLayers = 2, kHidden = 512, kHeads = 8, kKvHeads = 2, kHeadDim = 64, kFfn = 1024, kVocab = 1000;

inline Constant Contiguous(std::string name, DType dtype, std::vector<int64_t> sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * sizes[d];
  return {name, "zerokv/" + name, dtype, sizes, strides, 0};
}

struct TestBlob {
  std::string payload = "rms_eps 1e-05\nrope_attention_scaling 1\n";
  blob::Blob blob;

  TestBlob() {
    blob.engine_kind = blob::EngineKind::kMegakernel;
    auto& constants = blob.metadata.constants;
    const int64_t qkv = (kHeads + 2 * kKvHeads) * kHeadDim;
    for (int l = 0; l < kLayers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      constants.push_back(Contiguous(p + "input_norm", DType::kBfloat16, {kHidden}));
      constants.push_back(Contiguous(p + "qkv", DType::kBfloat16, {qkv, kHidden}));
      constants.push_back(Contiguous(p + "o", DType::kBfloat16, {kHidden, kHeads * kHeadDim}));
      constants.push_back(Contiguous(p + "post_norm", DType::kBfloat16, {kHidden}));
      constants.push_back(Contiguous(p + "gate", DType::kBfloat16, {kFfn, kHidden}));
      constants.push_back(Contiguous(p + "up", DType::kBfloat16, {kFfn, kHidden}));
      constants.push_back(Contiguous(p + "down", DType::kBfloat16, {kHidden, kFfn}));
    }
    constants.push_back(Contiguous("embedding", DType::kBfloat16, {kVocab, kHidden}));
    constants.push_back(Contiguous("lm_head", DType::kBfloat16, {kVocab, kHidden}));
    constants.push_back(Contiguous("final_norm", DType::kBfloat16, {kHidden}));
    constants.push_back(Contiguous("inv_freq", DType::kFloat32, {kHeadDim / 2}));
    auto& bindings = blob.metadata.bindings;
    auto add = [&](std::string name, blob::Direction direction, DType dtype) {
      bindings.push_back(IOBinding{name, dtype, direction, blob::Device::kCuda, {}});
    };
    add("token", blob::Direction::kInput, DType::kInt64);
    add("position", blob::Direction::kInput, DType::kInt64);
    for (int l = 0; l < kLayers; ++l) {
      add("k_cache_" + std::to_string(l), blob::Direction::kInput, DType::kBfloat16);
      add("v_cache_" + std::to_string(l), blob::Direction::kInput, DType::kBfloat16);
    }
    for (int l = 0; l < kLayers; ++l) {
      add("k_cache_" + std::to_string(l) + "_out", blob::Direction::kOutput, DType::kBfloat16);
      add("v_cache_" + std::to_string(l) + "_out", blob::Direction::kOutput, DType::kBfloat16);
    }
    add("logits", blob::Direction::kOutput, DType::kBfloat16);
  }

  Constant& constant(const std::string& name) {
    for (Constant& c : blob.metadata.constants) {
      if (c.name == name) return c;
    }
    ADD_FAILURE() << "no constant " << name;
    return blob.metadata.constants[0];
  }

  // The engine CreateEngine (the registry, so the kind's factory) makes of the blob.
  Status Create(const NamedDataMap* named_data, std::unique_ptr<Engine>* engine) {
    blob.payload = reinterpret_cast<const uint8_t*>(payload.data());
    blob.payload_size = payload.size();
    return CreateEngine(blob, named_data, engine);
  }

  // The message it refuses the blob with.
  std::string Refusal() {
    std::unique_ptr<Engine> engine;
    Status status = Create(nullptr, &engine);
    EXPECT_FALSE(status.ok());
    return status.message();
  }
};

}  // namespace zerokv::engines::megakernel::testing
