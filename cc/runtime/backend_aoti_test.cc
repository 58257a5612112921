// The backend end to end on the CPU, through ExecuTorch's BackendInterface, with a real
// AOTInductor decode step (py/zerokv/aoti:decode_blobs): two steps, the second sees the KV the
// first wrote, and the engine wrote through the caller's buffer (pointer and bytes). Then every
// refusal: a truncated or corrupt blob, a wrong argument count, a host-resident alias target, each
// a clear error with the caller's buffers untouched.
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>
#include <gtest/gtest.h>

#include "cc/runtime/backend.h"
#include "cc/runtime/delegate.h"
#include "cc/runtime/testing/et_tensor.h"
#include "cc/runtime/testing/binding_recorder.h"

namespace zerokv::runtime {
namespace {

using executorch::aten::ScalarType;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::BackendInterface;
using executorch::runtime::DelegateHandle;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::Span;
using testing::OwnedTensor;
using ET = executorch::runtime::etensor::DeviceType;

constexpr int kPositions = 8;
constexpr int kCacheFloats = 2 * kPositions * 4;

std::vector<uint8_t> ReadBlob(const char* env) {
  const char* path = std::getenv(env);
  EXPECT_NE(path, nullptr) << env;
  std::ifstream file(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(file), {});
}

class BackendAotiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executorch::runtime::runtime_init();
    backend_ = executorch::runtime::get_backend_class(kBackendName);
    ASSERT_NE(backend_, nullptr) << "ZeroKVBackend is not registered";
  }
  executorch::runtime::Result<DelegateHandle*> Init(std::vector<uint8_t>& bytes) {
    BackendInitContext context(nullptr, nullptr, "forward");
    FreeableBuffer processed(bytes.data(), bytes.size(), nullptr);
    return backend_->init(context, &processed, {});
  }
  Error Execute(DelegateHandle* handle, std::vector<EValue*> args) {
    BackendExecutionContext context;
    return backend_->execute(context, handle, Span<EValue*>(args.data(), args.size()));
  }

  BackendInterface* backend_ = nullptr;
};

// Step inputs: x (1, 2, 1, 4) = value, pos = position.
struct Step {
  OwnedTensor<float> x{ScalarType::Float, {1, 2, 1, 4}, ET::CUDA};
  OwnedTensor<int64_t> pos{ScalarType::Long, {1}, ET::CUDA};
  OwnedTensor<float> attention{ScalarType::Float, {1, 2, 4}, ET::CUDA};
  Step(float value, int64_t position) {
    for (int i = 0; i < 8; ++i) x.data()[i] = value;
    pos.data()[0] = position;
  }
};

TEST_F(BackendAotiTest, TwoDecodeStepsWriteTheCallersCacheInPlace) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_ELIDED_BLOB");
  auto handle = Init(bytes);
  ASSERT_TRUE(handle.ok());
  auto* delegate = static_cast<Delegate*>(handle.get());
  ASSERT_EQ(delegate->arity(), 4u);  // x, pos, k_cache, attention: k_cache_out is elided

  // The caller's cache, in "device" memory (ExecuTorch would have planned it there).
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  const float* caller_buffer = cache.data();

  Step first(1.5f, 2);
  ASSERT_EQ(Execute(*handle, {first.x.value(), first.pos.value(), cache.value(),
                              first.attention.value()}),
            Error::Ok);
  EXPECT_EQ(delegate->bound_address("k_cache"), caller_buffer);
  EXPECT_EQ(delegate->bound_address("k_cache_out"), caller_buffer);
  EXPECT_EQ(first.attention.data()[0], 3.0f);  // 2 * 1.5: only position 2 is set

  Step second(0.25f, 5);
  ASSERT_EQ(Execute(*handle, {second.x.value(), second.pos.value(), cache.value(),
                              second.attention.value()}),
            Error::Ok);
  EXPECT_EQ(delegate->bound_address("k_cache_out"), caller_buffer);
  // The binding trace (what tests through ExecuTorch's Method use) reports the same address.
  EXPECT_EQ(testing::BoundAddress("k_cache_out"), caller_buffer);
  EXPECT_EQ(cache.data(), caller_buffer);
  // The second step read the first step's write: 2 * (1.5 + 0.25).
  for (int i = 0; i < 8; ++i) EXPECT_EQ(second.attention.data()[i], 3.5f) << i;
  // Bytes: positions 2 and 5 of both rows hold the writes; every other byte is still zero.
  for (int row = 0; row < 2; ++row) {
    for (int position = 0; position < kPositions; ++position) {
      const float expected = position == 2 ? 1.5f : position == 5 ? 0.25f : 0.0f;
      for (int h = 0; h < 4; ++h) {
        EXPECT_EQ(cache.data()[(row * kPositions + position) * 4 + h], expected)
            << row << "," << position << "," << h;
      }
    }
  }
  backend_->destroy(*handle);
}

TEST_F(BackendAotiTest, NotElidedBlobTakesTheAliasedOutputArgument) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_NOT_ELIDED_BLOB");
  auto handle = Init(bytes);
  ASSERT_TRUE(handle.ok());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  OwnedTensor<float> cache_out(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  Step step(2.0f, 7);
  // The engine binding order puts the aliased output first among the outputs.
  ASSERT_EQ(Execute(*handle, {step.x.value(), step.pos.value(), cache.value(), cache_out.value(),
                              step.attention.value()}),
            Error::Ok);
  EXPECT_EQ(static_cast<Delegate*>(*handle)->bound_address("k_cache_out"), cache.data());
  EXPECT_EQ(cache.data()[7 * 4], 2.0f);
  EXPECT_EQ(cache_out.data()[7 * 4], 2.0f);
  backend_->destroy(*handle);
}

TEST_F(BackendAotiTest, TruncatedOrCorruptBlobIsRefusedAtInit) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_ELIDED_BLOB");
  std::vector<uint8_t> truncated(bytes.begin(), bytes.begin() + bytes.size() / 2);
  auto refused = Init(truncated);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error(), Error::InvalidProgram);

  std::vector<uint8_t> bad_magic = bytes;
  bad_magic[0] ^= 0xff;
  EXPECT_EQ(Init(bad_magic).error(), Error::InvalidProgram);

  // A payload that is not an AOTInductor package: the header and metadata are intact.
  std::vector<uint8_t> bad_payload = bytes;
  for (size_t i = bytes.size() - 64; i < bytes.size(); ++i) bad_payload[i] = 0;
  for (size_t i = bytes.size() / 2; i < bytes.size() / 2 + 64; ++i) bad_payload[i] ^= 0x5a;
  EXPECT_EQ(Init(bad_payload).error(), Error::InvalidProgram);
}

TEST_F(BackendAotiTest, WrongArgumentCountAndHostAliasTargetLeaveTheCacheUntouched) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_ELIDED_BLOB");
  auto handle = Init(bytes);
  ASSERT_TRUE(handle.ok());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  OwnedTensor<float> cache_out(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  Step step(9.0f, 1);
  for (int i = 0; i < 8; ++i) step.attention.data()[i] = -1.0f;

  // The not-elided call shape against an elided blob.
  EXPECT_EQ(Execute(*handle, {step.x.value(), step.pos.value(), cache.value(), cache_out.value(),
                              step.attention.value()}),
            Error::InvalidArgument);
  // The cache planned on the host.
  OwnedTensor<float> host_cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CPU);
  EXPECT_EQ(Execute(*handle, {step.x.value(), step.pos.value(), host_cache.value(),
                              step.attention.value()}),
            Error::InvalidArgument);
  for (int i = 0; i < kCacheFloats; ++i) {
    ASSERT_EQ(cache.data()[i], 0.0f);
    ASSERT_EQ(cache_out.data()[i], 0.0f);
    ASSERT_EQ(host_cache.data()[i], 0.0f);
  }
  for (int i = 0; i < 8; ++i) EXPECT_EQ(step.attention.data()[i], -1.0f);
  backend_->destroy(*handle);
}

}  // namespace
}  // namespace zerokv::runtime
