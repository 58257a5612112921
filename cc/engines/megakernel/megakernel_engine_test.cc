// The MEGAKERNEL engine's refusals of a blob it cannot run, each naming what is at fault. They come
// before any CUDA call, so no GPU is needed.
#include "cc/engines/megakernel/megakernel_engine.h"

#include <string>

#include "cc/engines/megakernel/test_blob.h"
#include "gtest/gtest.h"

namespace zerokv::engines::megakernel {
namespace {

using testing::Contiguous;
using testing::kHeadDim;
using testing::kHidden;
using testing::TestBlob;
using blob::DType;

TEST(MegakernelEngineTest, AValidBlobPassesEveryCheckOfTheBlob) {
  // What remains is the device: no GPU here, or on a GPU no named data to read the weights from.
  const std::string refusal = TestBlob().Refusal();
  EXPECT_TRUE(refusal.find("selecting CUDA device 0") != std::string::npos ||
              refusal.find("has no named data") != std::string::npos)
      << refusal;
}

TEST(MegakernelEngineTest, TakesTheBlobsNamesForTheBindings) {
  TestBlob renamed;
  for (blob::IOBinding& binding : renamed.blob.metadata.bindings) binding.name = "exported_" + binding.name;
  const std::string refusal = renamed.Refusal();
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
            "megakernel: binding 10 'logits' is (OUTPUT, FLOAT32); the step's logits is (OUTPUT, BFLOAT16)");
  TestBlob twice;
  twice.blob.metadata.bindings[3].name = "k_cache_0";
  EXPECT_EQ(twice.Refusal(), "megakernel: bindings 2 and 3 are both named 'k_cache_0'");
  TestBlob fewer;
  fewer.blob.metadata.bindings.pop_back();
  EXPECT_EQ(fewer.Refusal(), "megakernel: the blob has 10 bindings; the step of 2 layers has 11");
}

}  // namespace
}  // namespace zerokv::engines::megakernel
