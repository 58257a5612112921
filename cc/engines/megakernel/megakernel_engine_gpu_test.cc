// The MEGAKERNEL engine on an sm_90 GPU: through the engine interface, a step is the kernel's own
// over the same weights and caches, and a refused step is reported by the next Enqueue.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "cc/engines/megakernel/llama_decode_step.h"
#include "cc/engines/megakernel/megakernel_engine.h"
#include "cc/engines/megakernel/test_blob.h"
#include "cc/engines/testing/in_memory_named_data.h"
#include "gtest/gtest.h"

namespace zerokv::engines::megakernel {
namespace {

using testing::kHeadDim;
using testing::kKvHeads;
using testing::kLayers;
using testing::kVocab;
using testing::TestBlob;

constexpr int kCapacity = 256;

using Weights = engines::testing::InMemoryNamedData;

uint16_t Bf16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// `n` BF16 values around `center`, up to `spread` away, from a fixed sequence.
std::vector<uint8_t> Bf16Values(size_t n, float center, float spread, uint32_t seed) {
  std::vector<uint8_t> bytes(2 * n);
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const uint16_t bits = Bf16Bits(center + spread * (static_cast<float>(seed >> 8) / (1 << 24) * 2 - 1));
    std::memcpy(&bytes[2 * i], &bits, 2);
  }
  return bytes;
}

void* DeviceCopy(const std::vector<uint8_t>& bytes) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}

std::vector<float> Logits(const void* device) {
  std::vector<uint16_t> bits(kVocab);
  EXPECT_EQ(cudaMemcpy(bits.data(), device, 2 * kVocab, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> values(kVocab);
  for (int i = 0; i < kVocab; ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(&values[i], &wide, 4);
  }
  return values;
}

class MegakernelEngineGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, 0) != cudaSuccess || properties.major != 9) {
      GTEST_SKIP() << "needs an sm_90 GPU (the step is sm_90a code)";
    }
    uint32_t seed = 1;
    for (const blob::Constant& c : blob_.blob.metadata.constants) {
      size_t n = 1;
      for (int64_t extent : c.sizes) n *= static_cast<size_t>(extent);
      if (c.name == "inv_freq") {
        std::vector<float> frequencies(n);
        for (size_t i = 0; i < n; ++i) frequencies[i] = std::pow(10000.f, -2.f * i / kHeadDim);
        weights_.entries[c.key].resize(4 * n);
        std::memcpy(weights_.entries[c.key].data(), frequencies.data(), 4 * n);
      } else {
        const bool norm = c.sizes.size() == 1;
        weights_.entries[c.key] = Bf16Values(n, norm ? 1.f : 0.f, norm ? 0.1f : 0.05f, seed++);
      }
    }
  }

  std::vector<uint8_t> Entry(const std::string& name) {
    return weights_.entries.at(blob_.constant(name).key);
  }

  TestBlob blob_;
  Weights weights_;
};

TEST_F(MegakernelEngineGpuTest, StepIsTheKernelsOverTheSameWeightsAndCaches) {
  std::unique_ptr<Engine> engine;
  Status created = blob_.Create(&weights_, &engine);
  ASSERT_TRUE(created.ok()) << created.message();

  const size_t cache_elements = static_cast<size_t>(kKvHeads) * kCapacity * kHeadDim;
  std::vector<void*> engine_caches, kernel_caches;
  for (int i = 0; i < 2 * kLayers; ++i) {
    const std::vector<uint8_t> history = Bf16Values(cache_elements, 0.f, 1.f, 100 + i);
    engine_caches.push_back(DeviceCopy(history));
    kernel_caches.push_back(DeviceCopy(history));
  }
  const int64_t token = 17, position = 100;
  std::vector<uint8_t> scalars(16);
  std::memcpy(&scalars[0], &token, 8);
  std::memcpy(&scalars[8], &position, 8);
  auto* inputs = static_cast<int64_t*>(DeviceCopy(scalars));
  void* engine_logits = DeviceCopy(std::vector<uint8_t>(2 * kVocab));

  ASSERT_TRUE(engine->SetInputShape("token", {1, 1}).ok());
  ASSERT_TRUE(engine->SetInputShape("position", {1}).ok());
  ASSERT_TRUE(engine->SetAddress("token", inputs, 8).ok());
  ASSERT_TRUE(engine->SetAddress("position", inputs + 1, 8).ok());
  for (int l = 0; l < kLayers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::string name = (kv ? "v_cache_" : "k_cache_") + std::to_string(l);
      void* cache = engine_caches[2 * l + kv];
      ASSERT_TRUE(engine->SetInputShape(name, {1, kKvHeads, kCapacity, kHeadDim}).ok());
      ASSERT_TRUE(engine->SetAddress(name, cache, 2 * cache_elements).ok());
      ASSERT_TRUE(engine->SetAddress(name + "_out", cache, 2 * cache_elements).ok());
    }
  }
  ASSERT_TRUE(engine->SetAddress("logits", engine_logits, 2 * kVocab).ok());
  Status ran = engine->Enqueue(nullptr);
  ASSERT_TRUE(ran.ok()) << ran.message();

  LlamaDecodeArgs args{};
  args.shape = {kLayers, testing::kHidden, testing::kHeads, kKvHeads, kHeadDim, testing::kFfn, kVocab, kCapacity,
                1e-5f};
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    auto bf16 = [&](const char* name) { return static_cast<const __nv_bfloat16*>(DeviceCopy(Entry(p + name))); };
    args.layer[l] = {bf16("input_norm"), bf16("qkv"), bf16("o"), bf16("post_norm"), bf16("gate"), bf16("up"),
                     bf16("down"), static_cast<__nv_bfloat16*>(kernel_caches[2 * l]),
                     static_cast<__nv_bfloat16*>(kernel_caches[2 * l + 1])};
  }
  args.embedding = static_cast<const __nv_bfloat16*>(DeviceCopy(Entry("embedding")));
  args.final_norm = static_cast<const __nv_bfloat16*>(DeviceCopy(Entry("final_norm")));
  args.lm_head = static_cast<const __nv_bfloat16*>(DeviceCopy(Entry("lm_head")));
  args.inv_freq = static_cast<const float*>(DeviceCopy(Entry("inv_freq")));
  args.token = inputs;
  args.position = inputs + 1;
  void* kernel_logits = DeviceCopy(std::vector<uint8_t>(2 * kVocab));
  args.logits = static_cast<__nv_bfloat16*>(kernel_logits);
  args.workspace = DeviceCopy(std::vector<uint8_t>(LlamaDecodeWorkspaceBytes(args.shape)));
  args.error = static_cast<uint32_t*>(DeviceCopy(std::vector<uint8_t>(4)));
  std::string why;
  ASSERT_EQ(LaunchLlamaDecodeStep(args, nullptr, &why), cudaSuccess) << why;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const std::vector<float> ours = Logits(engine_logits), kernels = Logits(kernel_logits);
  float largest = 0.f;
  for (int i = 0; i < kVocab; ++i) {
    ASSERT_TRUE(std::isfinite(ours[i])) << "logit " << i;
    // Every sum runs in one order (no atomics), so the same inputs give the same bits.
    EXPECT_EQ(ours[i], kernels[i]) << "logit " << i;
    largest = std::max(largest, std::fabs(kernels[i]));
  }
  EXPECT_GT(largest, 0.f);
  for (int i = 0; i < 2 * kLayers; ++i) {
    std::vector<uint16_t> a(cache_elements), b(cache_elements);
    ASSERT_EQ(cudaMemcpy(a.data(), engine_caches[i], 2 * cache_elements, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b.data(), kernel_caches[i], 2 * cache_elements, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int h = 0; h < kKvHeads; ++h) {
      for (int p = 0; p < kCapacity; ++p) {
        const size_t row = (static_cast<size_t>(h) * kCapacity + p) * kHeadDim;
        const bool same = std::memcmp(&a[row], &b[row], 2 * kHeadDim) == 0;
        // Only row `position` is written; the K/V projections are one warp's sum per row here.
        EXPECT_TRUE(same) << "cache " << i << " head " << h << " row " << p;
      }
    }
  }

  // A position at the capacity: nothing written, NaN logits, and the next Enqueue says why.
  const int64_t outside = kCapacity;
  ASSERT_EQ(cudaMemcpy(inputs + 1, &outside, 8, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(engine->Enqueue(nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (float logit : Logits(engine_logits)) ASSERT_TRUE(std::isnan(logit));
  Status refused = engine->Enqueue(nullptr);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("position was outside its KV caches' capacity"), std::string::npos)
      << refused.message();
  ASSERT_EQ(cudaMemcpy(inputs + 1, &position, 8, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_TRUE(engine->Enqueue(nullptr).ok()) << "the refusal is reported once";
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace zerokv::engines::megakernel
