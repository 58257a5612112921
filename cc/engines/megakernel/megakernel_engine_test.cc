// The MEGAKERNEL engine's refusals of a blob it cannot run, each naming what is at fault. They come
// before any CUDA call, so no GPU is needed.
#include "cc/engines/megakernel/megakernel_engine.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace zerokv::engines::megakernel {
namespace {

using blob::Constant;
using blob::DType;
using blob::IOBinding;

constexpr int kLayers = 2, kHidden = 512, kHeads = 8, kKvHeads = 2, kHeadDim = 64, kFfn = 1024, kVocab = 1000;

Constant Contiguous(std::string name, DType dtype, std::vector<int64_t> sizes) {
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

  // The message CreateEngine (the registry, so the kind's factory) refuses the blob with.
  std::string Refusal() {
    blob.payload = reinterpret_cast<const uint8_t*>(payload.data());
    blob.payload_size = payload.size();
    std::unique_ptr<Engine> engine;
    Status status = CreateEngine(blob, nullptr, &engine);
    EXPECT_FALSE(status.ok());
    return status.message();
  }
};

TEST(MegakernelEngineTest, AValidBlobPassesEveryCheckOfTheBlob) {
  // What remains is the device: no GPU here, or on a GPU no named data to read the weights from.
  const std::string refusal = TestBlob().Refusal();
  EXPECT_TRUE(refusal.find("selecting CUDA device 0") != std::string::npos ||
              refusal.find("has no named data") != std::string::npos)
      << refusal;
}

TEST(MegakernelEngineTest, RefusesAPayloadThatIsNotTheStepsSettings) {
  TestBlob missing;
  missing.payload = "rms_eps 1e-05\n";
  EXPECT_EQ(missing.Refusal(), "megakernel payload: rope_attention_scaling is not set");
  TestBlob unknown;
  unknown.payload += "rope_theta 500000\n";
  EXPECT_EQ(unknown.Refusal(),
            "megakernel payload: 'rope_theta 500000' is not a setting (rms_eps or rope_attention_scaling, then a "
            "space and its value)");
  TestBlob twice;
  twice.payload += "rms_eps 1e-06\n";
  EXPECT_EQ(twice.Refusal(), "megakernel payload: rms_eps is set twice");
  TestBlob garbled;
  garbled.payload = "rms_eps 1e-05x\nrope_attention_scaling 1\n";
  EXPECT_EQ(garbled.Refusal(), "megakernel payload: rms_eps is '1e-05x', not a finite positive number");
}

TEST(MegakernelEngineTest, NamesTheConstantAtFault) {
  TestBlob missing;
  auto& constants = missing.blob.metadata.constants;
  constants.erase(constants.begin() + 13);  // layers.1.down
  EXPECT_EQ(missing.Refusal(), "megakernel constant 'layers.1.down' is missing");

  TestBlob dtype;
  dtype.constant("inv_freq").dtype = DType::kBfloat16;
  EXPECT_EQ(dtype.Refusal(), "megakernel constant 'inv_freq' is BFLOAT16, not FLOAT32");

  TestBlob strided;
  strided.constant("layers.0.o").strides = {1, kHidden};
  EXPECT_EQ(strided.Refusal(), "megakernel constant 'layers.0.o' is not contiguous (strides [1, 512] for shape "
                               "[512, 512])");

  TestBlob shape;
  shape.constant("layers.1.gate") = Contiguous("layers.1.gate", DType::kBfloat16, {2048, kHidden});
  EXPECT_EQ(shape.Refusal(), "megakernel constant 'layers.1.gate' has shape [2048, 512], not [1024, 512]");

  TestBlob extra;
  extra.blob.metadata.constants.push_back(Contiguous("layers.0.q_bias", DType::kBfloat16, {kHidden}));
  EXPECT_EQ(extra.Refusal(), "megakernel constant 'layers.0.q_bias' is not one the step reads");
}

TEST(MegakernelEngineTest, RefusesAModelTheStepCannotRun) {
  TestBlob wide_heads;
  wide_heads.constant("inv_freq") = Contiguous("inv_freq", DType::kFloat32, {32 * 2});
  EXPECT_EQ(wide_heads.Refusal(), "megakernel: the step cannot run this model: head_dim is 128, not 64");
}

TEST(MegakernelEngineTest, RefusesBindingsThatAreNotTheSteps) {
  TestBlob logits;
  logits.blob.metadata.bindings.back().dtype = DType::kFloat32;
  EXPECT_EQ(logits.Refusal(),
            "megakernel: binding 10 is 'logits' (OUTPUT, FLOAT32), not 'logits' (OUTPUT, BFLOAT16)");
  TestBlob fewer;
  fewer.blob.metadata.bindings.pop_back();
  EXPECT_EQ(fewer.Refusal(), "megakernel: the blob has 10 bindings; the step of 2 layers has 11");
}

}  // namespace
}  // namespace zerokv::engines::megakernel
