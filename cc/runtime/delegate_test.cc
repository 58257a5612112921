// Delegate tests with a scripted engine and a counting stand-in for the CUDA device: arity,
// recorded elision, aliasing, staging, streams and every refusal (with the caller's buffers left
// untouched).
#include "cc/runtime/delegate.h"

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <gtest/gtest.h>

#include "cc/base/testing/counting_device_ops.h"
#include "cc/engines/testing/test_engine.h"
#include "cc/kvcache/sequence.h"
#include "cc/runtime/caller_stream.h"
#include "cc/runtime/testing/et_tensor.h"
#include "cc/runtime/testing/runtime_kv_model.h"

namespace zerokv::runtime {
namespace {

using base::Internal;

using blob::AliasedIO;
using blob::AliasKind;
using blob::Device;
using blob::Dim;
using blob::Direction;
using blob::DType;
using blob::IOBinding;
using base::ComputeDevice;
using engines::TestEngine;
using executorch::aten::ScalarType;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::Span;
using base::testing::CountingDeviceOps;
using testing::EngineBindingsOf;
using testing::OwnedTensor;
using testing::RuntimeKvBlob;
using testing::RuntimeKvEngine;
using testing::WithLayers;
using ET = executorch::runtime::etensor::DeviceType;

constexpr int kPositions = 8;
constexpr int kCacheFloats = 1 * 2 * kPositions * 4;

// tokens [1, 0..4] int64 -> logits [1, T, 3]; k_cache [1, 2, 8, 4] written in place at tokens[0].
blob::Blob DecodeBlob(bool elided) {
  blob::Blob blob;
  blob.engine_kind = blob::EngineKind::kTensorrt;
  blob.aliased_outputs_elided = elided;
  auto cache = [](const char* name, Direction direction) {
    return IOBinding{name, DType::kFloat32, direction, Device::kCuda,
                     {Dim{1, 1}, Dim{2, 2}, Dim{kPositions, kPositions}, Dim{4, 4}}};
  };
  blob.metadata.bindings = {
      IOBinding{"tokens", DType::kInt64, Direction::kInput, Device::kCuda, {Dim{1, 1}, Dim{0, 4}}},
      cache("k_cache", Direction::kInput),
      IOBinding{"logits", DType::kFloat32, Direction::kOutput, Device::kCuda,
                {Dim{1, 1}, Dim{0, 4}, Dim{3, 3}}},
      cache("k_cache_out", Direction::kOutput),
  };
  blob.metadata.aliased_io = {AliasedIO{"k_cache_out", "k_cache", AliasKind::kKvCacheUpdate}};
  return blob;
}

// The engine's "network": marks position tokens[0] of every cache row with 7 (through the address
// bound to k_cache_out), and fills logits with 1.
std::unique_ptr<TestEngine> DecodeEngine(const blob::Blob& blob, ComputeDevice device,
                                         std::map<std::string, std::string> aliases = {
                                             {"k_cache_out", "k_cache"}}) {
  auto engine = std::make_unique<TestEngine>(EngineBindingsOf(blob), std::move(aliases), device);
  engine->on_enqueue = [](TestEngine& e) {
    const int64_t steps = e.input_shapes["tokens"][1];
    e.output_shapes["logits"] = {1, steps, 3};
    e.output_shapes["k_cache_out"] = {1, 2, kPositions, 4};
    if (steps > 0) {
      const int64_t position = static_cast<const int64_t*>(e.bound["tokens"].data)[0];
      float* cache = static_cast<float*>(e.bound["k_cache_out"].data);
      for (int row = 0; row < 2; ++row) cache[(row * kPositions + position) * 4] = 7.0f;
    }
    float* logits = static_cast<float*>(e.bound["logits"].data);
    for (int64_t i = 0; i < steps * 3; ++i) logits[i] = 1.0f;
    return Status::Ok();
  };
  return engine;
}

class DelegateTest : public ::testing::Test {
 protected:
  // Creates the delegate of `method`; `engine_` stays readable (the delegate owns it).
  Status Create(const blob::Blob& blob, std::unique_ptr<TestEngine> engine,
                const std::string& method = "decode") {
    engine_ = engine.get();
    return Delegate::Create(blob, std::move(engine),
                            std::make_unique<CountingDeviceOps>(&record_), method, &delegate_);
  }
  // Another delegate, e.g. of another method of the same program, on the same counting device.
  std::unique_ptr<Delegate> CreateAnother(const blob::Blob& blob, std::unique_ptr<TestEngine> engine,
                                          const std::string& method, Status* status) {
    std::unique_ptr<Delegate> created;
    *status = Delegate::Create(blob, std::move(engine),
                               std::make_unique<CountingDeviceOps>(&record_), method, &created);
    return created;
  }
  void CreateOrDie(const blob::Blob& blob, ComputeDevice device) {
    Status status = Create(blob, DecodeEngine(blob, device));
    ASSERT_TRUE(status.ok()) << status.message();
  }
  // "Device memory": what CountingDeviceOps::IsDeviceMemory accepts.
  float* DeviceCache() {
    float* data = device_cache_.data();
    record_.device_memory.insert(data);
    return data;
  }
  // A decode step's arguments (the token, the cache, the logits), each in "device memory", and the
  // delegate's argument list over them.
  struct DeviceArgs {
    explicit DeviceArgs(DelegateTest& test)
        : tokens(ScalarType::Long, {1, 1}, ET::CUDA),
          cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, test.DeviceCache()),
          logits(ScalarType::Float, {1, 4, 3}, ET::CUDA) {
      test.record_.device_memory.insert(tokens.data());
      test.record_.device_memory.insert(logits.data());
    }
    OwnedTensor<int64_t> tokens;
    OwnedTensor<float> cache;
    OwnedTensor<float> logits;
    EValue* args[3] = {tokens.value(), cache.value(), logits.value()};
  };

  CountingDeviceOps::Record record_;
  TestEngine* engine_ = nullptr;
  std::unique_ptr<Delegate> delegate_;
  std::vector<float> device_cache_ = std::vector<float>(kCacheFloats, 0.0f);
};

// blob's one dtype table names, for every blob dtype, the ExecuTorch ScalarType of that size and kind.
TEST(DTypeTableTest, EveryBlobDTypeIsTheExecuTorchScalarTypeOfItsSize) {
  const std::map<DType, std::string> expected = {
      {DType::kFloat32, "Float"}, {DType::kFloat16, "Half"},  {DType::kBfloat16, "BFloat16"},
      {DType::kInt32, "Int"},     {DType::kInt64, "Long"},    {DType::kInt8, "Char"},
      {DType::kUint8, "Byte"},    {DType::kBool, "Bool"},
  };
  for (int value = 0; value < 256; ++value) {
    const DType dtype = static_cast<DType>(value);
    if (!blob::IsValid(dtype)) continue;
    SCOPED_TRACE(blob::ToString(dtype));
    std::optional<int8_t> code = blob::ScalarTypeCode(dtype);
    ASSERT_TRUE(code.has_value());
    const auto scalar_type = static_cast<executorch::aten::ScalarType>(*code);
    EXPECT_EQ(executorch::runtime::toString(scalar_type), expected.at(dtype));
    EXPECT_EQ(executorch::runtime::elementSize(scalar_type), blob::ElementBytes(dtype));
  }
}

TEST_F(DelegateTest, ZeroCopyBindsTheAliasedOutputToTheCallersCache) {
  CreateOrDie(DecodeBlob(/*elided=*/true), ComputeDevice::kCuda);
  ASSERT_EQ(delegate_->arity(), 3u);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
  tokens.data()[0] = 5;
  record_.device_memory.insert(tokens.data());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  Status status = delegate_->Execute(Span<EValue*>(args, 3));
  ASSERT_TRUE(status.ok()) << status.message();

  // The engine wrote through the caller's pointer, and nothing was copied.
  EXPECT_EQ(engine_->bound["k_cache_out"].data, cache.data());
  EXPECT_EQ(engine_->bound["k_cache"].data, cache.data());
  EXPECT_EQ(delegate_->bound_address("k_cache_out"), cache.data());
  EXPECT_EQ(cache.data()[5 * 4], 7.0f);
  EXPECT_EQ(cache.data()[(kPositions + 5) * 4], 7.0f);
  EXPECT_EQ(cache.data()[4 * 4], 0.0f);
  EXPECT_TRUE(record_.copies.empty());
  // The output was resized to what the engine produced.
  EXPECT_EQ(logits.tensor().size(1), 1);
}

TEST_F(DelegateTest, NextExecuteWaitsOnTheInFlightEventAndDestroyDrainsIt) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  DeviceArgs step(*this);
  auto& [tokens, cache, logits, args] = step;

  int caller_stream = 0;
  CallerStreamGuard guard(&caller_stream);
  for (int64_t position : {2, 3}) {
    tokens.data()[0] = position;
    Status status = delegate_->Execute(Span<EValue*>(args, 3));
    ASSERT_TRUE(status.ok()) << status.message();
  }
  // The second step saw the first step's write: both positions are marked.
  EXPECT_EQ(cache.data()[2 * 4], 7.0f);
  EXPECT_EQ(cache.data()[3 * 4], 7.0f);
  EXPECT_EQ(record_.stream_waits, 1);
  EXPECT_EQ(record_.synchronizations, 0);
  delegate_.reset();
  EXPECT_EQ(record_.synchronizations, 1);
  EXPECT_EQ(record_.allocations_live, 0);
  EXPECT_EQ(record_.streams_destroyed, 1);
}

TEST_F(DelegateTest, RunsOnTheCallersStreamWhenOneIsSet) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  DeviceArgs step(*this);
  auto& [tokens, cache, logits, args] = step;

  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  StreamHandle own_stream = engine_->last_stream;
  ASSERT_NE(own_stream, nullptr);
  int caller_stream = 0;
  {
    CallerStreamGuard guard(&caller_stream);
    ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
    EXPECT_EQ(engine_->last_stream, &caller_stream);
  }
  EXPECT_FALSE(CurrentCallerStream().has_value());
  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(engine_->last_stream, own_stream);
}

// Without a caller stream nothing outside zerokv can order work after the delegate's own stream
// (not ExecuTorch's output copies through any DeviceAllocator, not the reader of a device-resident
// output), so execute finishes that stream before it returns.
TEST_F(DelegateTest, WithoutACallerStreamExecuteFinishesItsOwnStreamBeforeReturning) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  DeviceArgs step(*this);
  auto& [tokens, cache, logits, args] = step;

  for (int step = 1; step <= 2; ++step) {
    ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
    ASSERT_NE(engine_->last_stream, nullptr);
    EXPECT_EQ(record_.synchronized_streams,
              std::vector<StreamHandle>(static_cast<size_t>(step), engine_->last_stream));
  }
  // Finished work leaves nothing for the next execute to wait on.
  EXPECT_EQ(record_.stream_waits, 0);
  EXPECT_TRUE(record_.copies.empty());
}

// Under a caller stream the caller orders its own consumers: execute returns with the work in
// flight, and a later execute on another stream waits for it on the device.
TEST_F(DelegateTest, UnderACallerStreamExecuteReturnsWithTheWorkInFlight) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  DeviceArgs step(*this);
  auto& [tokens, cache, logits, args] = step;

  int caller_stream = 0;
  {
    CallerStreamGuard guard(&caller_stream);
    ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  }
  EXPECT_EQ(record_.synchronizations, 0);
  EXPECT_EQ(record_.events_recorded, 1);
  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(record_.stream_waits, 1);
  EXPECT_EQ(record_.synchronized_streams, std::vector<StreamHandle>{engine_->last_stream});
}

// A guard over nullptr selects the legacy default stream; it is not "no caller stream".
TEST_F(DelegateTest, AnExplicitlyNullCallerStreamSelectsTheLegacyDefaultStream) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  DeviceArgs step(*this);
  auto& [tokens, cache, logits, args] = step;

  CallerStreamGuard guard(nullptr);
  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(engine_->enqueue_count, 1);
  EXPECT_EQ(engine_->last_stream, nullptr);
  EXPECT_EQ(record_.synchronizations, 0);
  EXPECT_EQ(record_.events_recorded, 1);
}

TEST_F(DelegateTest, WrongArgumentCountIsRefusedWithTheCacheUntouched) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  OwnedTensor<float> cache_out(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  // The not-elided shape of the call: one argument too many for a blob that records elision.
  EValue* args[] = {tokens.value(), cache.value(), logits.value(), cache_out.value()};

  Status status = delegate_->Execute(Span<EValue*>(args, 4));
  EXPECT_EQ(status.code(), Error::InvalidArgument);
  EXPECT_NE(status.message().find("takes 3 arguments"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("elided"), std::string::npos) << status.message();
  EXPECT_EQ(engine_->enqueue_count, 0);
  EXPECT_EQ(std::vector<float>(cache.data(), cache.data() + kCacheFloats),
            std::vector<float>(kCacheFloats, 0.0f));
}

TEST_F(DelegateTest, NotElidedTakesTheAliasedOutputAndReflectsIntoIt) {
  CreateOrDie(DecodeBlob(/*elided=*/false), ComputeDevice::kCuda);
  ASSERT_EQ(delegate_->arity(), 4u);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
  tokens.data()[0] = 1;
  record_.device_memory.insert(tokens.data());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  OwnedTensor<float> cache_out(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  record_.device_memory.insert(cache_out.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value(), cache_out.value()};

  // Three arguments is the elided shape: refused, since this blob records no elision.
  Status refused = delegate_->Execute(Span<EValue*>(args, 3));
  EXPECT_EQ(refused.code(), Error::InvalidArgument);
  EXPECT_NE(refused.message().find("not elided"), std::string::npos) << refused.message();

  Status status = delegate_->Execute(Span<EValue*>(args, 4));
  ASSERT_TRUE(status.ok()) << status.message();
  // Still written in place; the separate output receives one device-to-device copy.
  EXPECT_EQ(engine_->bound["k_cache_out"].data, cache.data());
  EXPECT_EQ(cache.data()[1 * 4], 7.0f);
  EXPECT_EQ(cache_out.data()[1 * 4], 7.0f);
  ASSERT_EQ(record_.copies.size(), 1u);
  EXPECT_EQ(record_.copies[0].kind, CopyKind::kDeviceToDevice);
  EXPECT_EQ(record_.copies[0].bytes, kCacheFloats * sizeof(float));
}

TEST_F(DelegateTest, HostResidentAliasTargetIsRefused) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
  record_.device_memory.insert(tokens.data());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CPU);
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  Status status = delegate_->Execute(Span<EValue*>(args, 3));
  EXPECT_EQ(status.code(), Error::InvalidArgument);
  EXPECT_NE(status.message().find("input 'k_cache' (argument 1) is host-resident"),
            std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("must be device-resident"), std::string::npos);
  EXPECT_EQ(engine_->enqueue_count, 0);
  EXPECT_TRUE(record_.copies.empty());
}

TEST_F(DelegateTest, DevicePlannedPointerThatIsNotDeviceMemoryIsRefused) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
  record_.device_memory.insert(tokens.data());
  // Tagged CUDA but in memory the device does not recognise.
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  Status status = delegate_->Execute(Span<EValue*>(args, 3));
  EXPECT_EQ(status.code(), Error::InvalidArgument);
  EXPECT_NE(status.message().find("'k_cache'"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("not CUDA memory"), std::string::npos) << status.message();
  EXPECT_EQ(engine_->enqueue_count, 0);
}

// Asking the driver where a pointer lives is a call per argument; planned buffers stay put, so an
// argument is asked about again only when its address changes, and a new address is still refused.
TEST_F(DelegateTest, AnArgumentsAddressIsConfirmedAsCudaMemoryOnceUntilItChanges) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  DeviceArgs step(*this);
  auto& [tokens, cache, logits, args] = step;

  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(record_.device_memory_queries, 3);
  tokens.data()[0] = 1;
  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(record_.device_memory_queries, 3);

  OwnedTensor<float> elsewhere(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);  // not device memory
  args[1] = elsewhere.value();
  Status status = delegate_->Execute(Span<EValue*>(args, 3));
  EXPECT_EQ(status.code(), Error::InvalidArgument);
  EXPECT_NE(status.message().find("'k_cache'"), std::string::npos) << status.message();
  EXPECT_EQ(record_.device_memory_queries, 4);
  EXPECT_EQ(engine_->enqueue_count, 2);
}

TEST_F(DelegateTest, StagesHostInputsAndOutputsAndSynchronizesOnlyThen) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 2}, ET::CPU);  // host: staged in
  tokens.data()[0] = 6;
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CPU);  // host: staged out
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  Status status = delegate_->Execute(Span<EValue*>(args, 3));
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_NE(engine_->bound["tokens"].data, tokens.data());
  EXPECT_NE(engine_->bound["logits"].data, logits.data());
  EXPECT_EQ(engine_->bound["k_cache_out"].data, cache.data());
  ASSERT_EQ(record_.copies.size(), 2u);
  EXPECT_EQ(record_.copies[0].kind, CopyKind::kHostToDevice);
  EXPECT_EQ(record_.copies[0].bytes, 2 * sizeof(int64_t));
  EXPECT_EQ(record_.copies[1].kind, CopyKind::kDeviceToHost);
  EXPECT_EQ(record_.copies[1].bytes, 2 * 3 * sizeof(float));
  EXPECT_EQ(logits.data()[5], 1.0f);
  EXPECT_EQ(cache.data()[6 * 4], 7.0f);
  EXPECT_EQ(record_.synchronizations, 1);
  EXPECT_EQ(record_.events_recorded, 0);
}

// On a caller's stream the caller may write an input's host buffer once execute returns; a copy from
// page-locked memory reads it only when the stream gets there, so that step finishes the stream.
TEST_F(DelegateTest, UnderACallerStreamAStagedInputInPageLockedMemoryFinishesTheStream) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 2}, ET::CPU);  // host: staged in
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};
  int caller_stream = 0;
  CallerStreamGuard guard(&caller_stream);

  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());  // pageable: left in flight
  EXPECT_EQ(record_.synchronizations, 0);
  EXPECT_EQ(record_.events_recorded, 1);

  record_.page_locked.insert(tokens.data());
  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(record_.synchronized_streams, std::vector<StreamHandle>{&caller_stream});
  EXPECT_EQ(record_.events_recorded, 1);
  EXPECT_EQ(record_.page_locked_queries, 2);  // asked at each step
}

TEST_F(DelegateTest, AnArgumentWhoseLargestSizeOverflowsIsNotStaged) {
  // 8 bytes x 2^62 tokens: the largest size the blob allows does not fit in a size_t.
  blob::Blob blob = DecodeBlob(true);
  blob.metadata.bindings[0].shape[1] = Dim{0, int64_t{1} << 62};
  CreateOrDie(blob, ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 2}, ET::CPU);  // host: would be staged
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  Status status = delegate_->Execute(Span<EValue*>(args, 3));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("'tokens'"), std::string::npos) << status.message();
  EXPECT_EQ(engine_->enqueue_count, 0);
  EXPECT_TRUE(record_.copies.empty());
}

TEST_F(DelegateTest, HostEngineNeverStages) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kHost);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CPU);
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CPU);
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(engine_->bound["tokens"].data, tokens.data());
  EXPECT_EQ(engine_->bound["k_cache_out"].data, cache.data());
  EXPECT_TRUE(record_.copies.empty());
  EXPECT_EQ(record_.synchronizations, 0);
}

TEST_F(DelegateTest, ZeroByteInputIsBoundToAValidAddressWithoutStaging) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 0}, ET::CPU);
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  Status status = delegate_->Execute(Span<EValue*>(args, 3));
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_NE(engine_->bound["tokens"].data, nullptr);
  EXPECT_EQ(engine_->bound["tokens"].capacity, 0u);
  EXPECT_EQ(engine_->input_shapes["tokens"], (std::vector<int64_t>{1, 0}));
  EXPECT_TRUE(record_.copies.empty());
  EXPECT_EQ(logits.tensor().size(1), 0);
}

TEST_F(DelegateTest, DtypeRankAndShapeErrorsNameTheArgument) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<float> float_tokens(ScalarType::Float, {1, 1}, ET::CUDA);
  OwnedTensor<int64_t> long_tokens(ScalarType::Long, {1, 5}, ET::CUDA);
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> flat_logits(ScalarType::Float, {12}, ET::CUDA);
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);

  EValue* wrong_dtype[] = {float_tokens.value(), cache.value(), logits.value()};
  Status status = delegate_->Execute(Span<EValue*>(wrong_dtype, 3));
  EXPECT_NE(status.message().find("input 'tokens' (argument 0) has dtype Float"),
            std::string::npos)
      << status.message();
  EValue* too_long[] = {long_tokens.value(), cache.value(), logits.value()};
  status = delegate_->Execute(Span<EValue*>(too_long, 3));
  EXPECT_NE(status.message().find("dim 1 must lie in [0, 4]"), std::string::npos)
      << status.message();
  EValue* wrong_rank[] = {long_tokens.value(), cache.value(), flat_logits.value()};
  long_tokens.tensor().unsafeGetTensorImpl();
  status = delegate_->Execute(Span<EValue*>(wrong_rank, 3));
  EXPECT_FALSE(status.ok());
  EValue not_a_tensor(int64_t{3});
  EValue* scalar[] = {&not_a_tensor, cache.value(), logits.value()};
  status = delegate_->Execute(Span<EValue*>(scalar, 3));
  EXPECT_NE(status.message().find("input 'tokens' (argument 0) is not a tensor"),
            std::string::npos)
      << status.message();
  EXPECT_EQ(engine_->enqueue_count, 0);
}

// Create() refusals: the blob and the engine must agree on everything that decides arity and
// which caller buffers change.
TEST_F(DelegateTest, DuplicateAliasIsRefused) {
  blob::Blob blob = DecodeBlob(true);
  blob.metadata.aliased_io.push_back(blob.metadata.aliased_io[0]);
  Status status = Create(blob, DecodeEngine(blob, ComputeDevice::kCuda));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("'k_cache_out' is aliased twice"), std::string::npos)
      << status.message();
}

TEST_F(DelegateTest, AliasTheEngineDoesNotReportIsRefused) {
  blob::Blob blob = DecodeBlob(true);
  Status status = Create(blob, DecodeEngine(blob, ComputeDevice::kCuda, /*aliases=*/{}));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("but the engine does not alias it"), std::string::npos)
      << status.message();
}

TEST_F(DelegateTest, EngineAliasMissingFromTheBlobIsRefused) {
  blob::Blob blob = DecodeBlob(false);
  blob.metadata.aliased_io.clear();
  Status status = Create(blob, DecodeEngine(blob, ComputeDevice::kCuda));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("records no such alias"), std::string::npos)
      << status.message();
}

TEST_F(DelegateTest, BindingMismatchIsRefused) {
  blob::Blob blob = DecodeBlob(true);
  std::vector<engines::EngineBinding> bindings = EngineBindingsOf(blob);
  bindings[0].dtype = DType::kInt32;
  auto engine = std::make_unique<TestEngine>(
      bindings, std::map<std::string, std::string>{{"k_cache_out", "k_cache"}});
  Status status = Create(blob, std::move(engine));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("binding 'tokens' is INPUT INT64 in the blob but INPUT INT32"),
            std::string::npos)
      << status.message();
}

class RuntimeKvTest : public DelegateTest {
 protected:
  // One step of `steps` tokens whose caller says it starts at `position` (the position argument
  // holds `position_elements` values from there; the runtime overrides them). The logits are
  // readable after it.
  Status Step(Delegate& delegate, int64_t position, int steps, int position_elements = 1) {
    tokens_ = std::make_unique<OwnedTensor<int64_t>>(ScalarType::Long, std::vector<int32_t>{1, steps},
                                                     ET::CUDA);
    record_.device_memory.insert(tokens_->data());
    position_ = std::make_unique<OwnedTensor<int64_t>>(
        ScalarType::Long, std::vector<int32_t>{position_elements}, ET::CUDA);
    for (int i = 0; i < position_elements; ++i) position_->data()[i] = position + i;
    record_.device_memory.insert(position_->data());
    logits_ = std::make_unique<OwnedTensor<float>>(ScalarType::Float, std::vector<int32_t>{1, 4, 3},
                                                   ET::CUDA);
    record_.device_memory.insert(logits_->data());
    if (delegate.arity() == 3) {
      EValue* args[] = {tokens_->value(), position_->value(), logits_->value()};
      return delegate.Execute(Span<EValue*>(args, 3));
    }
    // A ring's slots argument: the caller's values are out of range, the runtime's are not.
    slots_ = std::make_unique<OwnedTensor<int32_t>>(ScalarType::Int, std::vector<int32_t>{steps},
                                                    ET::CUDA);
    for (int t = 0; t < steps; ++t) slots_->data()[t] = -1;
    record_.device_memory.insert(slots_->data());
    EValue* args[] = {tokens_->value(), position_->value(), slots_->value(), logits_->value()};
    return delegate.Execute(Span<EValue*>(args, 4));
  }
  // The cache of `key` in `sequence`, by default the implicit one (delegates loaded without one).
  static kvcache::KVCacheMetrics Metrics(const std::string& key,
                                         std::shared_ptr<kvcache::Sequence> sequence = nullptr) {
    if (sequence == nullptr) sequence = kvcache::Sequence::FindImplicit();
    std::shared_ptr<kvcache::KVCache> cache = sequence ? sequence->Find(key) : nullptr;
    EXPECT_NE(cache, nullptr) << key;
    return cache ? cache->metrics() : kvcache::KVCacheMetrics{};
  }
  static float K(const Delegate& delegate, int64_t capacity, int64_t row, int64_t position) {
    return static_cast<const float*>(delegate.bound_address("k"))[(row * capacity + position) * 4];
  }
  // Everything a refused step must leave as it was: the cache's contents, length and position.
  struct CacheState {
    std::vector<uint8_t> k, v;
    uint64_t length = 0, position = 0, capacity = 0;
    bool operator==(const CacheState& other) const {
      return k == other.k && v == other.v && length == other.length &&
             position == other.position && capacity == other.capacity;
    }
  };
  static CacheState Snapshot(const std::string& key) {
    std::shared_ptr<kvcache::KVCache> cache = kvcache::Sequence::FindImplicit()->Find(key);
    const auto* k = static_cast<const uint8_t*>(cache->k());
    const auto* v = static_cast<const uint8_t*>(cache->v());
    const size_t bytes = cache->bytes_per_tensor();
    const kvcache::KVCacheMetrics metrics = cache->metrics();
    return CacheState{std::vector<uint8_t>(k, k + bytes), std::vector<uint8_t>(v, v + bytes),
                      metrics.length, metrics.position, metrics.capacity};
  }
  // Whether every cache use recorded before the `free`-th FreeAsync was over or waited for when it
  // was made: the host synchronized after the last use recorded before it, or the stream had waited
  // `waits` times by then.
  bool EveryUseOverAtFree(size_t free, int waits) {
    const std::vector<std::string>& ordering = record_.ordering;
    size_t at = 0;
    for (size_t frees = 0; at < ordering.size(); ++at) {
      if (ordering[at] == "free" && frees++ == free) break;
    }
    bool synchronized = false;
    for (size_t i = at; i-- > 0 && ordering[i] != "record";) synchronized |= ordering[i] == "synchronize";
    return synchronized || record_.async_frees[free].stream_waits >= waits;
  }
  // What the engine was bound to for an int64 input, `count` values.
  std::vector<int64_t> Bound64(const std::string& name, size_t count) {
    const auto* data = static_cast<const int64_t*>(engine_->bound[name].data);
    return std::vector<int64_t>(data, data + count);
  }

  std::unique_ptr<OwnedTensor<int64_t>> tokens_;
  std::unique_ptr<OwnedTensor<int64_t>> position_;
  std::unique_ptr<OwnedTensor<int32_t>> slots_;
  std::unique_ptr<OwnedTensor<float>> logits_;
};

// After 6 committed positions the caller says the next token is at 2: the runtime writes it at 6,
// leaving position 2 as committed, because the positions the engine sees are the runtime's.
TEST_F(RuntimeKvTest, TheRuntimeSuppliesTheStepsPositionWhateverTheCallerPasses) {
  const std::string key = "delegate_test.positions";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  EXPECT_EQ(delegate_->arity(), 3u);  // tokens, position, logits: the caches are not arguments
  for (int64_t position = 0; position < 6; ++position) ASSERT_TRUE(Step(*delegate_, position, 1).ok());
  ASSERT_EQ(Metrics(key).length, 6u);

  Status status = Step(*delegate_, 2, 1);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(Metrics(key).length, 7u);
  EXPECT_EQ(K(*delegate_, 8, 0, 2), 3.0f);  // committed position 2 kept its token
  EXPECT_EQ(K(*delegate_, 8, 0, 6), 7.0f);  // the new token went to position 6
  EXPECT_EQ(K(*delegate_, 8, 1, 6), 7.0f);
  EXPECT_EQ(logits_->data()[0], 7.0f);      // and saw positions 0..6, no gap
  // The engine read a buffer of the runtime's; the caller's tensor is untouched.
  EXPECT_NE(engine_->bound["position"].data, position_->data());
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{6});
  EXPECT_EQ(position_->data()[0], 2);
}

// A position argument of the step's width gets every token's position.
TEST_F(RuntimeKvTest, APerTokenPositionArgumentGetsEachTokensPosition) {
  const std::string key = "delegate_test.per_token";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64, Dim{1, -1}, blob::KVPolicy::kFlat, 0, Dim{1, 4});
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  ASSERT_TRUE(Step(*delegate_, 0, 2, 2).ok());
  Status status = Step(*delegate_, 40, 3, 3);  // a prefill chunk the caller placed at 40
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(Bound64("position", 3), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(Metrics(key).length, 5u);
  for (int64_t position = 0; position < 5; ++position) {
    EXPECT_EQ(K(*delegate_, 8, 0, position), static_cast<float>(position + 1)) << position;
  }
  // Any other number of positions cannot be filled: refused, naming the argument.
  Status refused = Step(*delegate_, 5, 3, 2);
  EXPECT_EQ(refused.code(), Error::InvalidArgument);
  EXPECT_NE(refused.message().find("input 'position' (argument 1) holds 2 positions"),
            std::string::npos)
      << refused.message();
  EXPECT_EQ(Metrics(key).length, 5u);
}

// A failed run commits nothing; its retry, whatever positions the caller passes, writes the same
// positions again: no gap, and nothing committed is overwritten. A reset restarts at position 0.
TEST_F(RuntimeKvTest, RetriesAndResetsNeverLeaveGapsOrOverwriteCommittedPositions) {
  const std::string key = "delegate_test.retry";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  for (int64_t position = 0; position < 3; ++position) ASSERT_TRUE(Step(*delegate_, position, 1).ok());
  auto model = engine_->on_enqueue;
  engine_->on_enqueue = [](TestEngine&) { return Internal("scripted engine failure"); };
  EXPECT_EQ(Step(*delegate_, 3, 1).code(), Error::Internal);
  engine_->on_enqueue = model;
  ASSERT_TRUE(Step(*delegate_, 9, 1).ok());  // the retry, at a position the caller got wrong
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{3});
  EXPECT_EQ(Metrics(key).length, 4u);
  EXPECT_EQ(logits_->data()[0], 4.0f);

  ASSERT_TRUE(kvcache::Sequence::FindImplicit()->Reset().ok());
  ASSERT_TRUE(Step(*delegate_, 4, 1).ok());  // the caller forgot the reset
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{0});
  EXPECT_EQ(logits_->data()[0], 1.0f);
}

TEST_F(RuntimeKvTest, DecodesPastTheInitialCapacityGrowingAndKeepingContents) {
  const std::string key = "delegate_test.grows";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  for (int64_t position = 0; position < 20; ++position) {
    Status status = Step(*delegate_, position, 1);
    ASSERT_TRUE(status.ok()) << position << ": " << status.message();
    EXPECT_EQ(logits_->data()[0], static_cast<float>(position + 1)) << position;
  }
  const kvcache::KVCacheMetrics metrics = Metrics(key);
  EXPECT_EQ(metrics.length, 20u);
  EXPECT_EQ(metrics.capacity, 32u);
  EXPECT_EQ(metrics.growths, 3u);  // 4 -> 8 -> 16 -> 32
  EXPECT_EQ(metrics.bytes_moved, 2u * 2 * 4 * sizeof(float) * (4 + 8 + 16));
  // Bound at the current capacity, the aliased outputs at the inputs' storage.
  EXPECT_EQ(engine_->input_shapes["k"], (std::vector<int64_t>{1, 2, 32, 4}));
  EXPECT_EQ(engine_->bound["k_out"].data, engine_->bound["k"].data);
  EXPECT_EQ(engine_->bound["v_out"].data, engine_->bound["v"].data);
  EXPECT_EQ(engine_->bound["k"].capacity, 2u * 32 * 4 * sizeof(float));
  for (int64_t position = 0; position < 20; ++position) {
    EXPECT_EQ(K(*delegate_, 32, 1, position), static_cast<float>(position + 1)) << position;
  }
  EXPECT_EQ(K(*delegate_, 32, 1, 20), 0.0f);  // grown storage is zeroed
  // Growth and use on the delegate's own stream, which each execute finishes before returning;
  // the host blocks for nothing else.
  EXPECT_EQ(record_.synchronizations, 20);
}

TEST_F(RuntimeKvTest, StepWidthComesFromTheSourceArgumentsExtent) {
  const std::string key = "delegate_test.prefill";
  blob::Blob blob = RuntimeKvBlob(key, 2, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  ASSERT_TRUE(Step(*delegate_, 0, 3).ok());  // a prefill of 3: allocated at 4 at once, no growth
  EXPECT_EQ(Metrics(key).length, 3u);
  EXPECT_EQ(Metrics(key).capacity, 4u);
  EXPECT_EQ(Metrics(key).growths, 0u);
  ASSERT_TRUE(Step(*delegate_, 3, 4).ok());
  EXPECT_EQ(Metrics(key).length, 7u);
  EXPECT_EQ(Metrics(key).capacity, 8u);
  EXPECT_EQ(Metrics(key).growths, 1u);
}

TEST_F(RuntimeKvTest, FailedEngineRunDoesNotAdvanceTheCache) {
  const std::string key = "delegate_test.failed_run";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  for (int64_t position = 0; position < 4; ++position) ASSERT_TRUE(Step(*delegate_, position, 1).ok());
  auto model = engine_->on_enqueue;
  engine_->on_enqueue = [](TestEngine&) { return Internal("scripted engine failure"); };
  Status failed = Step(*delegate_, 4, 1);  // grows first, then the run fails
  EXPECT_EQ(failed.code(), Error::Internal);
  EXPECT_EQ(Metrics(key).length, 4u);
  EXPECT_EQ(Metrics(key).capacity, 8u);  // the growth stands, its contents intact
  EXPECT_EQ(K(*delegate_, 8, 0, 3), 4.0f);
  engine_->on_enqueue = model;
  ASSERT_TRUE(Step(*delegate_, 4, 1).ok());
  EXPECT_EQ(Metrics(key).length, 5u);
  EXPECT_EQ(logits_->data()[0], 5.0f);
}

TEST_F(RuntimeKvTest, AStepWiderThanTheRemainingCapacityIsRefusedBeforeAnythingIsBound) {
  const std::string key = "delegate_test.full";
  blob::Blob blob = RuntimeKvBlob(key, 4, 8, Dim{4, 8});
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  ASSERT_TRUE(Step(*delegate_, 0, 4).ok());
  ASSERT_TRUE(Step(*delegate_, 4, 2).ok());
  const CacheState before = Snapshot(key);
  const int enqueued = engine_->enqueue_count;
  const int waits = record_.stream_waits;
  Status refused = Step(*delegate_, 6, 3);  // 2 positions remain
  EXPECT_EQ(refused.code(), Error::InvalidArgument);
  EXPECT_NE(refused.message().find("input 'tokens' (argument 0) makes this step write 3 tokens "
                                   "into KV storage 'delegate_test.full'"),
            std::string::npos)
      << refused.message();
  EXPECT_NE(refused.message().find("a step of 3 tokens after 6 would exceed the KV cache's "
                                   "max_capacity of 8"),
            std::string::npos)
      << refused.message();
  EXPECT_EQ(engine_->enqueue_count, enqueued);
  EXPECT_EQ(record_.stream_waits, waits);
  EXPECT_TRUE(Snapshot(key) == before);
  ASSERT_TRUE(Step(*delegate_, 6, 2).ok());  // what fits still does
  EXPECT_EQ(Metrics(key).length, 8u);
}

// A method whose tensors do not match the blob (dtype, rank, extent, device) is refused before
// anything is bound, naming the argument; every cache keeps its contents, length and position.
TEST_F(RuntimeKvTest, BadArgumentsAreRefusedNamingTheInputWithEveryCacheUnchanged) {
  const std::string key = "delegate_test.bad_arguments";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  for (int64_t position = 0; position < 3; ++position) ASSERT_TRUE(Step(*delegate_, position, 1).ok());
  const CacheState before = Snapshot(key);
  const int enqueued = engine_->enqueue_count;

  auto device_tensor = [&](ScalarType type, std::vector<int32_t> sizes, int8_t index = 0) {
    auto tensor = std::make_unique<OwnedTensor<int64_t>>(type, sizes, ET::CUDA, nullptr, index);
    record_.device_memory.insert(tensor->data());
    return tensor;
  };
  struct Case {
    const char* what;
    std::unique_ptr<OwnedTensor<int64_t>> tokens, position, logits;
    const char* message;
  };
  std::vector<Case> cases;
  cases.push_back({"tokens dtype", device_tensor(ScalarType::Int, {1, 1}), nullptr, nullptr,
                   "input 'tokens' (argument 0) has dtype Int, the blob INT64"});
  cases.push_back({"tokens rank", device_tensor(ScalarType::Long, {1, 1, 1}), nullptr, nullptr,
                   "input 'tokens' (argument 0) has rank 3, the blob 2"});
  cases.push_back({"tokens extent", device_tensor(ScalarType::Long, {1, 5}), nullptr, nullptr,
                   "input 'tokens' (argument 0) has shape [1, 5]; dim 1 must lie in [1, 4]"});
  cases.push_back({"position dtype", nullptr, device_tensor(ScalarType::Int, {1}), nullptr,
                   "input 'position' (argument 1) has dtype Int, the blob INT64"});
  cases.push_back({"position rank", nullptr, device_tensor(ScalarType::Long, {1, 1}), nullptr,
                   "input 'position' (argument 1) has rank 2, the blob 1"});
  cases.push_back({"logits dtype", nullptr, nullptr, device_tensor(ScalarType::Long, {1, 4, 3}),
                   "output 'logits' (argument 2) has dtype Long, the blob FLOAT32"});
  cases.push_back({"tokens device", std::make_unique<OwnedTensor<int64_t>>(
                                        ScalarType::Long, std::vector<int32_t>{1, 1}, ET::CUDA),
                   nullptr, nullptr,
                   "input 'tokens' (argument 0) is planned in CUDA memory but its pointer is not "
                   "CUDA memory"});
  cases.push_back({"tokens device index", device_tensor(ScalarType::Long, {1, 1}, 1), nullptr,
                   nullptr, "input 'tokens' (argument 0) is planned on cuda:1, but the delegate "
                            "runs on cuda:0"});
  for (Case& bad : cases) {
    OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
    OwnedTensor<int64_t> position(ScalarType::Long, {1}, ET::CUDA);
    OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
    for (const void* data : {static_cast<const void*>(tokens.data()),
                             static_cast<const void*>(position.data()),
                             static_cast<const void*>(logits.data())}) {
      record_.device_memory.insert(data);
    }
    EValue* args[] = {bad.tokens ? bad.tokens->value() : tokens.value(),
                      bad.position ? bad.position->value() : position.value(),
                      bad.logits ? bad.logits->value() : logits.value()};
    Status refused = delegate_->Execute(Span<EValue*>(args, 3));
    EXPECT_EQ(refused.code(), Error::InvalidArgument) << bad.what;
    EXPECT_NE(refused.message().find(bad.message), std::string::npos)
        << bad.what << ": " << refused.message();
    EXPECT_EQ(engine_->enqueue_count, enqueued) << bad.what;
    EXPECT_TRUE(Snapshot(key) == before) << bad.what;
  }
  ASSERT_TRUE(Step(*delegate_, 0, 1).ok());
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{3});
}

// A binding the engine reads on the host (the blob says CPU) cannot take a CUDA-planned tensor on
// a CUDA engine: the engine would dereference a device pointer on the host.
TEST_F(RuntimeKvTest, ADevicePlannedArgumentOfAHostBindingIsRefused) {
  const std::string key = "delegate_test.host_binding";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  blob.metadata.bindings[0].device = Device::kCpu;  // tokens
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  const Status refused = Step(*delegate_, 0, 1);
  EXPECT_EQ(refused.code(), Error::InvalidArgument);
  EXPECT_NE(refused.message().find("input 'tokens' (argument 0) is planned in CUDA memory, but the "
                                   "engine reads it on the host"),
            std::string::npos)
      << refused.message();
  EXPECT_EQ(engine_->enqueue_count, 0);
  EXPECT_EQ(Metrics(key).length, 0u);
}

TEST_F(RuntimeKvTest, FailedGrowthAllocationAdvancesNothing) {
  const std::string key = "delegate_test.no_memory";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  // The growth's storage prepared ahead, after the run's K and V, fails: the step does not.
  record_.fail_async_allocation_in = 3;
  ASSERT_TRUE(Step(*delegate_, 0, 4).ok());
  EXPECT_EQ(Metrics(key).length, 4u);
  EXPECT_EQ(Metrics(key).bytes_reserved, 2u * 2 * 4 * sizeof(float) * 4);  // no reserve held
  const void* k = delegate_->bound_address("k");
  const int enqueued = engine_->enqueue_count;
  record_.fail_async_allocation_in = 2;  // V's new storage, after K's
  Status failed = Step(*delegate_, 4, 1);
  EXPECT_EQ(failed.code(), Error::MemoryAllocationFailed);
  EXPECT_EQ(engine_->enqueue_count, enqueued);
  EXPECT_EQ(Metrics(key).length, 4u);
  EXPECT_EQ(Metrics(key).capacity, 4u);
  EXPECT_EQ(Metrics(key).growths, 0u);
  ASSERT_TRUE(Step(*delegate_, 4, 1).ok());
  EXPECT_NE(delegate_->bound_address("k"), k);
  EXPECT_EQ(logits_->data()[0], 5.0f);
}

// Allocating every layer's next capacity in one step made that step several times slower than the
// others on the H200 (cudaMallocAsync's host time): each step prepares at most one cache's growth
// ahead, so the growth steps allocate nothing.
TEST_F(RuntimeKvTest, GrowthIsPreparedAndReleasedOneCachePerStepNeverInTheGrowthStep) {
  const std::string key = "delegate_test.spread";
  constexpr size_t kLayers = 4;
  blob::Blob blob = WithLayers(RuntimeKvBlob(key, 8, 64), kLayers);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  const int delegate_owned = record_.allocations_live;
  std::vector<std::shared_ptr<kvcache::KVCache>> caches;
  for (size_t i = 0; i < kLayers; ++i) {
    caches.push_back(
        kvcache::Sequence::FindImplicit()->Find(i == 0 ? key : key + "." + std::to_string(i)));
    ASSERT_NE(caches.back(), nullptr) << i;
  }
  ASSERT_TRUE(Step(*delegate_, 0, 1).ok());  // allocates every cache
  int growth_steps = 0;
  for (int64_t position = 1; position < 60; ++position) {
    const int allocated = record_.async_allocations;
    const int live = record_.allocations_live;
    const int waited = record_.stream_waits;
    const size_t freed = record_.async_frees.size();
    uint64_t growths = 0;
    for (const auto& cache : caches) growths += cache->metrics().growths;
    Status status = Step(*delegate_, position, 1);
    ASSERT_TRUE(status.ok()) << position << ": " << status.message();
    EXPECT_EQ(logits_->data()[0], static_cast<float>(position + 1)) << position;
    // K and V of one cache at most: a reserve, never a growth's storage.
    const int allocations = record_.async_allocations - allocated;
    EXPECT_LE(allocations, 2) << position;
    // The same for releases: the old storage of one cache at most, never in the growth step.
    const int releases = allocations - (record_.allocations_live - live);
    EXPECT_LE(releases, 2) << position;
    // On the run's stream, after every cache's last use finished: the host finished the stream
    // after recording them (the delegate's own stream) or the stream waited for each.
    for (size_t free = freed; free < record_.async_frees.size(); ++free) {
      EXPECT_EQ(record_.async_frees[free].stream, engine_->last_stream) << position;
      EXPECT_TRUE(EveryUseOverAtFree(free, waited + static_cast<int>(kLayers))) << position;
    }
    uint64_t grown = 0;
    for (const auto& cache : caches) grown += cache->metrics().growths;
    if (grown != growths) {
      EXPECT_EQ(grown - growths, kLayers) << position;  // every layer grows in the same step
      EXPECT_EQ(releases, 0) << position;
      ++growth_steps;
    }
  }
  EXPECT_EQ(growth_steps, 3);  // 8 -> 16 -> 32 -> 64
  // Each capacity was allocated once per cache: no reserve was wasted or leaked.
  EXPECT_EQ(record_.async_allocations, static_cast<int>(kLayers * 2 * 4));
  EXPECT_EQ(record_.allocations_live, delegate_owned + 2 * static_cast<int>(kLayers));
  for (size_t i = 0; i < kLayers; ++i) {
    const kvcache::KVCacheMetrics metrics = caches[i]->metrics();
    EXPECT_EQ(metrics.capacity, 64u) << i;
    EXPECT_EQ(metrics.length, 60u) << i;
    EXPECT_EQ(metrics.bytes_reserved, 2u * 2 * 4 * sizeof(float) * 64) << i;  // at max: no reserve
    const auto* k = static_cast<const float*>(caches[i]->k());
    for (int64_t at = 0; at < 64; ++at) {
      EXPECT_EQ(k[(64 + at) * 4], at < 60 ? at + 1.0f : 0.0f) << i << " " << at;
    }
  }
}

// On its own stream the delegate blocks the host once a step, after every cache's use is recorded
// (recording them overlaps the run's device work instead of following it). Each step then starts
// with every use finished, and orders its stream after none.
TEST_F(RuntimeKvTest, OnItsOwnStreamAStepRecordsEveryCachesUseBlocksOnceAndWaitsForNone) {
  const std::string key = "delegate_test.recorded";
  constexpr size_t kLayers = 3;
  blob::Blob blob = WithLayers(RuntimeKvBlob(key, 8, 64), kLayers);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  for (int64_t position = 0; position < 3; ++position) {
    const size_t before = record_.ordering.size();
    ASSERT_TRUE(Step(*delegate_, position, 1).ok()) << position;
    std::vector<std::string> expected(kLayers, "record");
    expected.push_back("synchronize");
    EXPECT_EQ(std::vector<std::string>(record_.ordering.begin() + before, record_.ordering.end()),
              expected)
        << position;
  }
}

// Once every layer holds its reserve, the engine is readied once (Prepare) for exactly the binding
// the growth step then has: every cache input and its aliased output at the reserve, at the grown
// shape, on the step's stream. The steps in between still run on the old storage.
TEST_F(RuntimeKvTest, TheEngineIsReadiedAheadForTheBindingOfEachGrowth) {
  const std::string key = "delegate_test.readied";
  constexpr size_t kLayers = 4;
  blob::Blob blob = WithLayers(RuntimeKvBlob(key, 8, 64), kLayers);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  std::vector<std::string> caches = {"k", "v"};
  for (size_t i = 1; i < kLayers; ++i) {
    caches.push_back("k." + std::to_string(i));
    caches.push_back("v." + std::to_string(i));
  }
  std::shared_ptr<kvcache::KVCache> first = kvcache::Sequence::FindImplicit()->Find(key);
  TestEngine::Preparation run;  // what each run was bound to, as it ran
  engine_->on_enqueue = [&run, network = engine_->on_enqueue](TestEngine& engine) {
    run = {engine.bound, engine.input_shapes, engine.last_stream};
    return network(engine);
  };
  ASSERT_TRUE(Step(*delegate_, 0, 1).ok());
  size_t growths = 0;
  for (int64_t position = 1; position < 60; ++position) {
    const size_t preparations = engine_->prepared.size();
    const uint64_t capacity = first->metrics().capacity;
    Status status = Step(*delegate_, position, 1);
    ASSERT_TRUE(status.ok()) << position << ": " << status.message();
    EXPECT_EQ(logits_->data()[0], static_cast<float>(position + 1)) << position;
    EXPECT_EQ(run.bound["k"].data, first->k()) << position;  // the live storage, reserve or not
    EXPECT_EQ(run.input_shapes["k"][2], static_cast<int64_t>(first->metrics().capacity)) << position;
    if (first->metrics().capacity == capacity) continue;
    ++growths;
    // The growth step ran on what the last Prepare was given, and it was given before this step.
    EXPECT_EQ(preparations, growths) << position;
    ASSERT_GE(engine_->prepared.size(), growths);
    const TestEngine::Preparation& readied = engine_->prepared[growths - 1];
    EXPECT_EQ(readied.stream, run.stream) << position;
    for (const std::string& name : caches) {
      for (const std::string& bound : {name, name + "_out"}) {
        EXPECT_EQ(readied.bound.at(bound).data, run.bound[bound].data) << position << " " << bound;
        EXPECT_EQ(readied.bound.at(bound).capacity, run.bound[bound].capacity) << position << " " << bound;
      }
      EXPECT_EQ(readied.input_shapes.at(name), run.input_shapes[name]) << position << " " << name;
    }
  }
  EXPECT_EQ(growths, 3u);                       // 8 -> 16 -> 32 -> 64
  EXPECT_EQ(engine_->prepared.size(), growths);  // once each, and never at the max (no reserve)
}

// An engine that fails to ready itself fails no step: every step commits, the growths keep the
// contents, and each set of reserves is offered once, not again at every step.
TEST_F(RuntimeKvTest, AnEngineThatFailsToReadyItselfFailsNoStep) {
  const std::string key = "delegate_test.unready";
  blob::Blob blob = WithLayers(RuntimeKvBlob(key, 8, 64), 2);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  engine_->prepare_status = Internal("test engine: scripted preparation failure");
  std::shared_ptr<kvcache::KVCache> first = kvcache::Sequence::FindImplicit()->Find(key);
  for (int64_t position = 0; position < 40; ++position) {
    Status status = Step(*delegate_, position, 1);
    ASSERT_TRUE(status.ok()) << position << ": " << status.message();
    EXPECT_EQ(logits_->data()[0], static_cast<float>(position + 1)) << position;
  }
  EXPECT_EQ(first->metrics().capacity, 64u);
  EXPECT_EQ(first->metrics().growths, 3u);
  EXPECT_EQ(engine_->prepared.size(), 3u);  // 16, 32 and 64: once each
  const auto* k = static_cast<const float*>(first->k());
  for (int64_t at = 0; at < 64; ++at) EXPECT_EQ(k[at * 4], at < 40 ? at + 1.0f : 0.0f) << at;
}

// A ring layer's write slots are the runtime's too: (position + t) mod window, in the slots
// argument the model indexes its write with; the caller's values are never read.
TEST_F(RuntimeKvTest, RingSlotsComeFromTheRuntime) {
  const std::string key = "delegate_test.ring";
  blob::Blob blob = RuntimeKvBlob(key, 6, 6, Dim{1, 6}, blob::KVPolicy::kRing, 6);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob, /*ring=*/true)).ok());
  for (int64_t position = 0; position < 9; ++position) {
    Status status = Step(*delegate_, 0, 1);
    ASSERT_TRUE(status.ok()) << position << ": " << status.message();
  }
  const kvcache::KVCacheMetrics metrics = Metrics(key);
  EXPECT_EQ(metrics.capacity, 6u);
  EXPECT_EQ(metrics.length, 6u);
  EXPECT_EQ(metrics.growths, 0u);
  EXPECT_EQ(K(*delegate_, 6, 0, 2), 9.0f);  // position 8 wrapped onto slot 2
  ASSERT_TRUE(Step(*delegate_, 0, 4).ok());  // positions 9..12
  const auto* slots = static_cast<const int32_t*>(engine_->bound["slots"].data);
  EXPECT_EQ(std::vector<int32_t>(slots, slots + 4), (std::vector<int32_t>{3, 4, 5, 0}));
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{9});
  EXPECT_EQ(K(*delegate_, 6, 0, 0), 13.0f);
  EXPECT_EQ(K(*delegate_, 6, 1, 5), 12.0f);
  EXPECT_EQ(Metrics(key).length, 6u);
}

TEST_F(RuntimeKvTest, DelegatesNamingOneStorageKeyShareIt) {
  const std::string key = "delegate_test.shared";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob), "prefill").ok());
  Status created;
  std::unique_ptr<Delegate> decode = CreateAnother(blob, RuntimeKvEngine(blob), "decode", &created);
  ASSERT_TRUE(created.ok()) << created.message();
  ASSERT_TRUE(Step(*delegate_, 0, 3).ok());  // "prefill"
  ASSERT_TRUE(Step(*decode, 3, 1).ok());     // "decode" sees the prefill's positions
  EXPECT_EQ(logits_->data()[0], 4.0f);
  EXPECT_EQ(decode->bound_address("k"), delegate_->bound_address("k"));
  EXPECT_EQ(Metrics(key).length, 4u);
  // The prefill's execute returned with its use of the cache over (it finished its own stream after
  // recording the use), so the decode's stream had nothing to wait for.
  EXPECT_EQ(record_.stream_waits, 0);
  {
    // Under a caller's stream an execute returns with its work in flight: the next one waits for it.
    int caller_stream = 0;
    CallerStreamGuard guard(&caller_stream);
    ASSERT_TRUE(Step(*delegate_, 4, 1).ok());
  }
  ASSERT_TRUE(Step(*decode, 5, 1).ok());
  EXPECT_EQ(record_.stream_waits, 1);
  EXPECT_EQ(Metrics(key).length, 6u);
  delegate_.reset();
  ASSERT_TRUE(Step(*decode, 6, 1).ok());  // still held by the decode delegate
  decode.reset();
  EXPECT_EQ(kvcache::Sequence::FindImplicit(), nullptr);  // and with it the cache
  EXPECT_EQ(record_.allocations_live, 0);
}

TEST_F(RuntimeKvTest, LoadRefusesWhatTheRuntimeCannotBind) {
  // The engine's positions dim cannot take the capacities the cache will have.
  blob::Blob static_positions = RuntimeKvBlob("delegate_test.static", 4, 64, Dim{8, 8});
  Status status = Create(static_positions, RuntimeKvEngine(static_positions));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("positions dim (2) admits [8, 8]"), std::string::npos)
      << status.message();

  // The engine computes K in another dtype than the manifest's.
  blob::Blob blob = RuntimeKvBlob("delegate_test.dtype", 4, 64);
  std::vector<engines::EngineBinding> bindings = EngineBindingsOf(blob);
  bindings[2].dtype = DType::kBfloat16;
  status = Create(blob, std::make_unique<TestEngine>(
                            bindings, std::map<std::string, std::string>{{"k_out", "k"}, {"v_out", "v"}},
                            ComputeDevice::kCuda));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("binding 'k' is INPUT FLOAT32 in the blob but INPUT BFLOAT16"),
            std::string::npos)
      << status.message();

  // The manifest names a binding the engine does not have.
  blob::Blob renamed = RuntimeKvBlob("delegate_test.renamed", 4, 64);
  bindings = EngineBindingsOf(renamed);
  bindings[3].name = "value_cache";
  status = Create(renamed, std::make_unique<TestEngine>(
                               bindings, std::map<std::string, std::string>{{"k_out", "k"}},
                               ComputeDevice::kCuda));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("'v', which the engine does not have"), std::string::npos)
      << status.message();

  // A storage key already held at another layout.
  blob::Blob first = RuntimeKvBlob("delegate_test.layout", 4, 64);
  std::unique_ptr<Delegate> holder = CreateAnother(first, RuntimeKvEngine(first), "prefill", &status);
  ASSERT_TRUE(status.ok()) << status.message();
  blob::Blob other = RuntimeKvBlob("delegate_test.layout", 8, 64);
  status = Create(other, RuntimeKvEngine(other));
  EXPECT_EQ(status.code(), Error::InvalidProgram);
  EXPECT_NE(status.message().find("'delegate_test.layout' is already held"), std::string::npos)
      << status.message();
}

// Two loads of one program never share caches unless the caller asks: without a sequence, the
// second instance of a method over the same storage is refused at load; under a sequence of its
// own it is isolated from the first.
TEST_F(RuntimeKvTest, ASecondLoadIsRefusedWithoutASequenceAndIsolatedUnderOne) {
  const std::string key = "delegate_test.two_loads";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  for (int64_t position = 0; position < 5; ++position) ASSERT_TRUE(Step(*delegate_, position, 1).ok());

  Status status;
  std::unique_ptr<Delegate> second = CreateAnother(blob, RuntimeKvEngine(blob), "decode", &status);
  EXPECT_EQ(status.code(), Error::InvalidState);
  EXPECT_NE(status.message().find("a loaded 'decode' delegate already uses KV storage "
                                  "'delegate_test.two_loads' without a sequence of its own"),
            std::string::npos)
      << status.message();
  EXPECT_EQ(second, nullptr);

  std::shared_ptr<kvcache::Sequence> b = kvcache::Sequence::Create();
  {
    kvcache::SequenceGuard guard(b);
    second = CreateAnother(blob, RuntimeKvEngine(blob), "decode", &status);
  }
  ASSERT_TRUE(status.ok()) << status.message();
  ASSERT_TRUE(Step(*second, 0, 3).ok());  // b's prefill: at home in b, without a guard now
  EXPECT_EQ(logits_->data()[0], 3.0f);
  EXPECT_EQ(Metrics(key, b).length, 3u);
  EXPECT_EQ(Metrics(key).length, 5u);
  ASSERT_TRUE(Step(*delegate_, 0, 1).ok());  // the first instance goes on where it was
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{5});
  EXPECT_EQ(logits_->data()[0], 6.0f);
  EXPECT_NE(delegate_->bound_address("k"), second->bound_address("k"));
}

// N conversations over one loaded program: a sequence selected around each execute, with its own
// caches, positions, reset and metrics.
TEST_F(RuntimeKvTest, SequencesSelectedAroundExecutesAreIndependent) {
  const std::string key = "delegate_test.sequences";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  std::shared_ptr<kvcache::Sequence> a = kvcache::Sequence::Create(), b = kvcache::Sequence::Create();
  auto step_on = [&](const std::shared_ptr<kvcache::Sequence>& sequence, int steps) {
    kvcache::SequenceGuard guard(sequence);
    Status status = Step(*delegate_, 0, steps);
    EXPECT_TRUE(status.ok()) << status.message();
  };
  step_on(a, 3);
  step_on(b, 2);
  step_on(a, 1);
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{3});
  EXPECT_EQ(logits_->data()[0], 4.0f);  // a saw its own 3 positions, not b's
  step_on(b, 1);
  EXPECT_EQ(Bound64("position", 1), std::vector<int64_t>{2});
  EXPECT_EQ(Metrics(key, a).length, 4u);
  EXPECT_EQ(Metrics(key, b).length, 3u);
  ASSERT_TRUE(b->Reset().ok());
  EXPECT_EQ(Metrics(key, b).length, 0u);
  EXPECT_EQ(Metrics(key, a).length, 4u);
  step_on(a, 1);
  EXPECT_EQ(logits_->data()[0], 5.0f);
  // The home (implicit) sequence was never written.
  EXPECT_EQ(Metrics(key).capacity, 0u);
}

// A reset while a step of the same sequence is in flight is refused, and leaves every cache as
// it was; the step completes.
TEST_F(RuntimeKvTest, AResetWhileAStepIsInFlightIsRefused) {
  const std::string key = "delegate_test.reset_in_flight";
  blob::Blob blob = RuntimeKvBlob(key, 4, 64);
  ASSERT_TRUE(Create(blob, RuntimeKvEngine(blob)).ok());
  for (int64_t position = 0; position < 3; ++position) ASSERT_TRUE(Step(*delegate_, position, 1).ok());
  auto model = engine_->on_enqueue;
  Status reset;
  engine_->on_enqueue = [&](TestEngine& e) {
    reset = kvcache::Sequence::FindImplicit()->Reset();  // e.g. another thread, mid-step
    return model(e);
  };
  ASSERT_TRUE(Step(*delegate_, 3, 1).ok());
  EXPECT_EQ(reset.code(), Error::InvalidState);
  EXPECT_NE(reset.message().find("cannot reset the sequence: KV storage "
                                 "'delegate_test.reset_in_flight'"),
            std::string::npos)
      << reset.message();
  EXPECT_EQ(Metrics(key).length, 4u);
  for (int64_t position = 0; position < 4; ++position) {
    EXPECT_EQ(K(*delegate_, 4, 0, position), static_cast<float>(position + 1)) << position;
  }
}

TEST_F(RuntimeKvTest, ParserRefusesABrokenManifest) {
  // What loading sees before the delegate: the blob parser's manifest checks.
  blob::Blob ring_without_window = RuntimeKvBlob("delegate_test.parse", 6, 6, Dim{1, 6},
                                                 blob::KVPolicy::kRing, 0);
  ring_without_window.payload = reinterpret_cast<const uint8_t*>("x");
  ring_without_window.payload_size = 1;
  std::vector<uint8_t> bytes;
  std::optional<blob::Error> error = blob::Serialize(ring_without_window, &bytes);
  ASSERT_TRUE(error.has_value());
  EXPECT_NE(error->message.find("a ring cache needs a window"), std::string::npos)
      << error->message;
}

}  // namespace
}  // namespace zerokv::runtime
