// Delegate tests with a scripted engine and a counting stand-in for the CUDA device: arity,
// recorded elision, aliasing, staging, streams and every refusal (with the caller's buffers left
// untouched).
#include "cc/runtime/delegate.h"

#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "cc/engines/testing/test_engine.h"
#include "cc/runtime/caller_stream.h"
#include "cc/runtime/testing/counting_device_ops.h"
#include "cc/runtime/testing/et_tensor.h"

namespace zerokv::runtime {
namespace {

using blob::AliasedIO;
using blob::AliasKind;
using blob::Device;
using blob::Dim;
using blob::Direction;
using blob::DType;
using blob::IOBinding;
using engines::ComputeDevice;
using engines::TestEngine;
using executorch::aten::ScalarType;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::Span;
using testing::CountingDeviceOps;
using testing::OwnedTensor;
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

std::vector<engines::EngineBinding> EngineBindingsOf(const blob::Blob& blob) {
  std::vector<engines::EngineBinding> bindings;
  for (const IOBinding& binding : blob.metadata.bindings) {
    bindings.push_back({binding.name, binding.direction, binding.dtype});
  }
  return bindings;
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
  // Creates the delegate; `engine_` stays readable (the delegate owns it).
  Status Create(const blob::Blob& blob, std::unique_ptr<TestEngine> engine) {
    engine_ = engine.get();
    return Delegate::Create(blob, std::move(engine),
                            std::make_unique<CountingDeviceOps>(&record_), &delegate_);
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

  CountingDeviceOps::Record record_;
  TestEngine* engine_ = nullptr;
  std::unique_ptr<Delegate> delegate_;
  std::vector<float> device_cache_ = std::vector<float>(kCacheFloats, 0.0f);
};

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

  // The engine wrote through the caller's pointer, and nothing was copied or waited for.
  EXPECT_EQ(engine_->bound["k_cache_out"].data, cache.data());
  EXPECT_EQ(engine_->bound["k_cache"].data, cache.data());
  EXPECT_EQ(delegate_->bound_address("k_cache_out"), cache.data());
  EXPECT_EQ(cache.data()[5 * 4], 7.0f);
  EXPECT_EQ(cache.data()[(kPositions + 5) * 4], 7.0f);
  EXPECT_EQ(cache.data()[4 * 4], 0.0f);
  EXPECT_TRUE(record_.copies.empty());
  EXPECT_EQ(record_.synchronizations, 0);
  EXPECT_EQ(record_.events_recorded, 1);
  // The output was resized to what the engine produced.
  EXPECT_EQ(logits.tensor().size(1), 1);
}

TEST_F(DelegateTest, NextExecuteWaitsOnTheInFlightEventAndDestroyDrainsIt) {
  CreateOrDie(DecodeBlob(true), ComputeDevice::kCuda);
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
  record_.device_memory.insert(tokens.data());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

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
  OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CUDA);
  record_.device_memory.insert(tokens.data());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, DeviceCache());
  OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CUDA);
  record_.device_memory.insert(logits.data());
  EValue* args[] = {tokens.value(), cache.value(), logits.value()};

  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  StreamHandle own_stream = engine_->last_stream;
  ASSERT_NE(own_stream, nullptr);
  int caller_stream = 0;
  {
    CallerStreamGuard guard(&caller_stream);
    ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
    EXPECT_EQ(engine_->last_stream, &caller_stream);
  }
  EXPECT_EQ(CurrentCallerStream(), nullptr);
  ASSERT_TRUE(delegate_->Execute(Span<EValue*>(args, 3)).ok());
  EXPECT_EQ(engine_->last_stream, own_stream);
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

TEST_F(DelegateTest, RuntimeOwnedKvLayersAreNotSupported) {
  blob::Blob blob = DecodeBlob(false);
  blob.metadata.kv_layers.push_back(blob::KVLayer{"k_cache", "k_cache", "layers.0", DType::kFloat32, 2, 4,
                                                  blob::KVPolicy::kFlat, 0, 8, 8});
  Status status = Create(blob, DecodeEngine(blob, ComputeDevice::kCuda));
  EXPECT_EQ(status.code(), Error::NotSupported);
  EXPECT_NE(status.message().find("kv_layers"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace zerokv::runtime
