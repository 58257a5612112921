// KVCache and Sequence on a counting stand-in for the device: capacity arithmetic, growth that
// keeps the contents (and what it copied), ring windows, positions, failure paths, steps and resets
// holding a cache, sequences (sharing, isolation, reset, metrics, the implicit one), the C API.
#include "cc/kvcache/kv_cache.h"

#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "cc/base/testing/counting_device_ops.h"
#include "cc/kvcache/c_api.h"
#include "cc/kvcache/sequence.h"

namespace zerokv::kvcache {
namespace {

using executorch::runtime::Error;
using base::CopyKind;
using base::testing::CountingDeviceOps;

KVCacheConfig Flat(uint64_t initial, uint64_t max) {
  KVCacheConfig config;
  config.dtype = blob::DType::kFloat32;
  config.batch = 1;
  config.heads = 2;
  config.head_dim = 4;
  config.initial_capacity = initial;
  config.max_capacity = max;
  return config;
}

KVCacheConfig Ring(uint64_t window) {
  KVCacheConfig config = Flat(1, window);
  config.policy = blob::KVPolicy::kRing;
  config.window = window;
  return config;
}

uint64_t Planned(const KVCacheConfig& config, uint64_t capacity, uint64_t length, uint64_t step) {
  uint64_t planned = 0;
  Status status = PlanCapacity(config, capacity, length, step, &planned);
  EXPECT_TRUE(status.ok()) << status.message();
  return planned;
}

TEST(PlanCapacityTest, FlatDoublesAsOftenAsNeededCappedAtMax) {
  const KVCacheConfig config = Flat(4, 40);
  EXPECT_EQ(Planned(config, 0, 0, 1), 4u);    // first step: the initial capacity
  EXPECT_EQ(Planned(config, 0, 0, 9), 16u);   // a wide first step starts larger, no copy
  EXPECT_EQ(Planned(config, 4, 3, 1), 4u);    // fits exactly
  EXPECT_EQ(Planned(config, 4, 4, 1), 8u);    // one doubling
  EXPECT_EQ(Planned(config, 4, 4, 13), 32u);  // 17 positions: two doublings
  EXPECT_EQ(Planned(config, 32, 32, 1), 40u);  // capped at max
  EXPECT_EQ(Planned(config, 32, 39, 1), 40u);
}

TEST(PlanCapacityTest, FlatPastMaxIsRefused) {
  uint64_t planned = 7;
  Status status = PlanCapacity(Flat(4, 40), 40, 40, 1, &planned);
  EXPECT_EQ(status.code(), Error::InvalidArgument);
  EXPECT_NE(status.message().find("max_capacity of 40"), std::string::npos) << status.message();
  EXPECT_EQ(planned, 7u);
  EXPECT_FALSE(PlanCapacity(Flat(4, 40), 0, 0, 41, &planned).ok());
  EXPECT_FALSE(PlanCapacity(Flat(4, 40), 4, ~uint64_t{0}, 2, &planned).ok());  // overflow
}

TEST(PlanCapacityTest, RingKeepsItsWindowAndRefusesWiderSteps) {
  const KVCacheConfig config = Ring(8);
  EXPECT_EQ(Planned(config, 0, 0, 8), 8u);
  EXPECT_EQ(Planned(config, 8, 8, 3), 8u);  // length saturates; positions wrap in the model
  uint64_t planned = 0;
  Status status = PlanCapacity(config, 8, 0, 9, &planned);
  EXPECT_EQ(status.code(), Error::InvalidArgument);
  EXPECT_NE(status.message().find("window of 8"), std::string::npos) << status.message();
}

TEST(CommittedLengthTest, FlatAddsRingSaturates) {
  EXPECT_EQ(CommittedLength(Flat(4, 40), 5, 3), 8u);
  EXPECT_EQ(CommittedLength(Ring(8), 5, 2), 7u);
  EXPECT_EQ(CommittedLength(Ring(8), 7, 3), 8u);
}

TEST(ValidateConfigTest, RefusesImpossibleConfigs) {
  KVCacheConfig ring_without_window = Ring(8);
  ring_without_window.window = 0;
  EXPECT_NE(ValidateConfig(ring_without_window).message().find("needs a window"),
            std::string::npos);
  EXPECT_FALSE(ValidateConfig(Flat(0, 8)).ok());
  EXPECT_FALSE(ValidateConfig(Flat(16, 8)).ok());
  KVCacheConfig no_heads = Flat(4, 8);
  no_heads.heads = 0;
  EXPECT_FALSE(ValidateConfig(no_heads).ok());
  EXPECT_EQ(KVCacheConfig().dtype, blob::DType::kBfloat16);  // the storage default
}

class KVCacheTest : public ::testing::Test {
 protected:
  std::unique_ptr<KVCache> Make(const KVCacheConfig& config) {
    std::unique_ptr<KVCache> cache;
    Status status = KVCache::Create(config, std::make_shared<CountingDeviceOps>(&record_), &cache);
    EXPECT_TRUE(status.ok()) << status.message();
    return cache;
  }

  // Writes `value` at `position` of every (batch, head) row of K and -value in V, as a model would.
  static void Write(KVCache& cache, uint64_t position, float value) {
    const std::vector<int64_t> shape = cache.shape();
    for (int64_t row = 0; row < shape[0] * shape[1]; ++row) {
      for (int64_t d = 0; d < shape[3]; ++d) {
        const int64_t at = (row * shape[2] + static_cast<int64_t>(position)) * shape[3] + d;
        static_cast<float*>(cache.k())[at] = value;
        static_cast<float*>(cache.v())[at] = -value;
      }
    }
  }
  static float At(const KVCache& cache, const void* data, int64_t row, uint64_t position) {
    const std::vector<int64_t> shape = cache.shape();
    return static_cast<const float*>(data)[(row * shape[2] + static_cast<int64_t>(position)) *
                                           shape[3]];
  }

  // Begin, prepare, write `step` positions from the step's position, mark, commit.
  void Step(KVCache& cache, uint64_t step, StreamHandle stream = nullptr) {
    uint64_t position = 0;
    ASSERT_TRUE(cache.BeginStep(step, &position).ok());
    Status prepared = cache.Prepare(stream);
    ASSERT_TRUE(prepared.ok()) << prepared.message();
    for (uint64_t i = 0; i < step; ++i) Write(cache, position + i, static_cast<float>(position + i + 1));
    ASSERT_TRUE(cache.MarkUsed(stream).ok());
    cache.EndStep(/*commit=*/true);
  }

  // A step that prepares the next growth, as the delegate does after a successful run: before
  // MarkUsed, on the step's stream.
  void StepPreparingGrowth(KVCache& cache, uint64_t step, uint64_t lookahead, StreamHandle stream,
                           bool* prepared) {
    uint64_t position = 0;
    ASSERT_TRUE(cache.BeginStep(step, &position).ok());
    ASSERT_TRUE(cache.Prepare(stream).ok());
    for (uint64_t i = 0; i < step; ++i) {
      Write(cache, position + i, static_cast<float>(position + i + 1));
    }
    Status status = cache.PrepareGrowth(lookahead, stream, prepared);
    ASSERT_TRUE(status.ok()) << status.message();
    ASSERT_TRUE(cache.MarkUsed(stream).ok());
    cache.EndStep(/*commit=*/true);
  }

  CountingDeviceOps::Record record_;
};

TEST_F(KVCacheTest, AllocatesZeroedStorageOnTheFirstStep) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  EXPECT_EQ(cache->k(), nullptr);
  EXPECT_EQ(cache->metrics().bytes_reserved, 0u);
  uint64_t position = 9;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  EXPECT_EQ(position, 0u);
  ASSERT_TRUE(cache->Prepare(nullptr).ok());
  EXPECT_EQ(cache->shape(), (std::vector<int64_t>{1, 2, 4, 4}));
  EXPECT_EQ(cache->bytes_per_tensor(), 2u * 4 * 4 * sizeof(float));
  for (int i = 0; i < 2 * 4 * 4; ++i) {
    EXPECT_EQ(static_cast<float*>(cache->k())[i], 0.0f);
    EXPECT_EQ(static_cast<float*>(cache->v())[i], 0.0f);
  }
  EXPECT_EQ(cache->metrics().growths, 0u);  // the first allocation moves nothing
  EXPECT_TRUE(record_.copies.empty());
  cache->EndStep(/*commit=*/true);
}

TEST_F(KVCacheTest, GrowthDoublesKeepsContentsAndCountsBytesMoved) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  StreamHandle stream = &record_;  // any non-null handle: the "stream" the copies go to
  for (int token = 0; token < 20; ++token) Step(*cache, 1, stream);
  const KVCacheMetrics metrics = cache->metrics();
  EXPECT_EQ(metrics.capacity, 32u);  // 4 -> 8 -> 16 -> 32
  EXPECT_EQ(metrics.growths, 3u);
  EXPECT_EQ(metrics.length, 20u);
  const uint64_t position_bytes = 2 * 4 * sizeof(float);  // heads * head_dim, one of K and V
  EXPECT_EQ(metrics.bytes_moved, 2 * position_bytes * (4 + 8 + 16));
  EXPECT_EQ(metrics.bytes_reserved, 2 * position_bytes * 32);
  EXPECT_EQ(metrics.bytes_in_use, 2 * position_bytes * 20);
  // One pitched copy per tensor per growth, of exactly the old contents, on the step's stream.
  ASSERT_EQ(record_.copies.size(), 6u);
  for (const CountingDeviceOps::Copied& copy : record_.copies) {
    EXPECT_EQ(copy.kind, CopyKind::kDeviceToDevice);
    EXPECT_EQ(copy.stream, stream);
  }
  // Every row still holds every committed position, and the rest is zero.
  for (int64_t row = 0; row < 2; ++row) {
    for (uint64_t position = 0; position < 32; ++position) {
      const float expected = position < 20 ? static_cast<float>(position + 1) : 0.0f;
      EXPECT_EQ(At(*cache, cache->k(), row, position), expected) << row << " " << position;
      EXPECT_EQ(At(*cache, cache->v(), row, position), -expected) << row << " " << position;
    }
  }
  // Old storage was released: K and V plus the event-free counting ops hold two allocations.
  EXPECT_EQ(record_.allocations_live, 2);
}

TEST_F(KVCacheTest, PrepareOrdersTheStreamAfterTheLastUse) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  Step(*cache, 1);
  EXPECT_EQ(record_.stream_waits, 0);  // nothing to wait for on the first use
  EXPECT_EQ(record_.events_recorded, 1);
  Step(*cache, 1);
  EXPECT_EQ(record_.stream_waits, 1);
  EXPECT_EQ(record_.events_recorded, 2);
}

// Once the host has finished the step's stream after its MarkUsed, nothing is left to wait for:
// the next Prepare orders nothing, and destroying the cache does not block.
TEST_F(KVCacheTest, AUseTheHostSawFinishIsNotWaitedFor) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  Step(*cache, 1);
  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  // Before the step's Prepare the last use may be running on another stream.
  EXPECT_EQ(cache->LastUseFinished().code(), Error::Internal);
  ASSERT_TRUE(cache->Prepare(nullptr).ok());
  ASSERT_TRUE(cache->MarkUsed(nullptr).ok());
  ASSERT_TRUE(cache->LastUseFinished().ok());
  cache->EndStep(/*commit=*/true);
  EXPECT_EQ(record_.stream_waits, 1);  // the first step's use, which nobody saw finish
  Step(*cache, 1);
  EXPECT_EQ(record_.stream_waits, 1);
  EXPECT_EQ(record_.events_recorded, 3);
  Step(*cache, 1);  // the last step's use, again unseen
  EXPECT_EQ(record_.stream_waits, 2);
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  ASSERT_TRUE(cache->Prepare(nullptr).ok());
  ASSERT_TRUE(cache->MarkUsed(nullptr).ok());
  ASSERT_TRUE(cache->LastUseFinished().ok());
  cache->EndStep(/*commit=*/true);
  const int synchronizations = record_.synchronizations;
  cache.reset();
  EXPECT_EQ(record_.synchronizations, synchronizations);
}

TEST_F(KVCacheTest, FailedGrowthLeavesStorageContentsAndLengthIntact) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  for (int token = 0; token < 4; ++token) Step(*cache, 1);
  void* const k = cache->k();
  void* const v = cache->v();
  const int live = record_.allocations_live;
  for (int failing : {1, 2}) {  // K's allocation fails; V's fails after K's succeeded
    record_.fail_async_allocation_in = failing;
    uint64_t position = 0;
    ASSERT_TRUE(cache->BeginStep(1, &position).ok());
    Status status = cache->Prepare(nullptr);
    cache->EndStep(/*commit=*/false);
    EXPECT_EQ(status.code(), Error::MemoryAllocationFailed);
    EXPECT_NE(status.message().find("growing a KV cache to 8 positions"), std::string::npos)
        << status.message();
  }
  EXPECT_EQ(cache->k(), k);
  EXPECT_EQ(cache->v(), v);
  EXPECT_EQ(cache->metrics().length, 4u);
  EXPECT_EQ(cache->metrics().capacity, 4u);
  EXPECT_EQ(cache->metrics().growths, 0u);
  EXPECT_EQ(record_.allocations_live, live);
  EXPECT_EQ(At(*cache, cache->k(), 1, 3), 4.0f);
  // The next attempt grows normally.
  Step(*cache, 1);
  EXPECT_EQ(cache->metrics().capacity, 8u);
  EXPECT_EQ(At(*cache, cache->k(), 1, 3), 4.0f);
}

TEST_F(KVCacheTest, RefusedStepChangesNothing) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 8));
  Step(*cache, 8);
  void* const k = cache->k();
  uint64_t position = 0;
  EXPECT_EQ(cache->BeginStep(1, &position).code(), Error::InvalidArgument);
  EXPECT_EQ(cache->k(), k);
  EXPECT_EQ(cache->metrics().length, 8u);
  // Refused without holding the cache: the next step (after a reset) is accepted.
  ASSERT_TRUE(cache->BeginReset().ok());
  cache->EndReset(/*reset=*/true);
  Step(*cache, 1);
}

TEST_F(KVCacheTest, AFailedStepCommitsNothingSoItsRetryGetsTheSamePosition) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  Step(*cache, 3);
  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(2, &position).ok());
  EXPECT_EQ(position, 3u);
  ASSERT_TRUE(cache->Prepare(nullptr).ok());
  cache->EndStep(/*commit=*/false);  // the run failed
  EXPECT_EQ(cache->metrics().length, 3u);
  EXPECT_EQ(cache->metrics().position, 3u);
  ASSERT_TRUE(cache->BeginStep(2, &position).ok());
  EXPECT_EQ(position, 3u);
  cache->EndStep(/*commit=*/true);
  EXPECT_EQ(cache->metrics().position, 5u);
}

TEST_F(KVCacheTest, AStepOrAResetHoldsTheCache) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  Step(*cache, 2);
  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  uint64_t other = 0;
  Status second = cache->BeginStep(1, &other);
  EXPECT_EQ(second.code(), Error::InvalidState);
  EXPECT_NE(second.message().find("must not overlap"), std::string::npos) << second.message();
  Status reset = cache->BeginReset();
  EXPECT_EQ(reset.code(), Error::InvalidState);
  EXPECT_NE(reset.message().find("in flight"), std::string::npos) << reset.message();
  cache->EndStep(/*commit=*/true);
  EXPECT_EQ(cache->metrics().length, 3u);  // the refused reset forgot nothing
  ASSERT_TRUE(cache->BeginReset().ok());
  EXPECT_EQ(cache->BeginStep(1, &other).code(), Error::InvalidState);
  cache->EndReset(/*reset=*/false);
  EXPECT_EQ(cache->metrics().length, 3u);
}

TEST_F(KVCacheTest, RingHoldsItsWindowAndSaturatesWhileItsPositionCountsOn) {
  std::unique_ptr<KVCache> cache = Make(Ring(6));
  for (int token = 0; token < 5; ++token) {
    uint64_t position = 0;
    ASSERT_TRUE(cache->BeginStep(2, &position).ok());
    EXPECT_EQ(position, 2u * token);
    ASSERT_TRUE(cache->Prepare(nullptr).ok());
    cache->EndStep(/*commit=*/true);
  }
  const KVCacheMetrics metrics = cache->metrics();
  EXPECT_EQ(metrics.capacity, 6u);
  EXPECT_EQ(metrics.length, 6u);
  EXPECT_EQ(metrics.position, 10u);
  EXPECT_EQ(metrics.growths, 0u);
  EXPECT_EQ(metrics.bytes_moved, 0u);
  uint64_t position = 0;
  EXPECT_EQ(cache->BeginStep(7, &position).code(), Error::InvalidArgument);
}

TEST_F(KVCacheTest, ResetForgetsPositionsAndZeroesOnTheNextStep) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  for (int token = 0; token < 6; ++token) Step(*cache, 1);
  ASSERT_TRUE(cache->BeginReset().ok());
  cache->EndReset(/*reset=*/true);
  KVCacheMetrics metrics = cache->metrics();
  EXPECT_EQ(metrics.length, 0u);
  EXPECT_EQ(metrics.position, 0u);
  EXPECT_EQ(metrics.bytes_in_use, 0u);
  EXPECT_EQ(metrics.capacity, 8u);  // the storage is kept
  uint64_t position = 9;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  EXPECT_EQ(position, 0u);
  ASSERT_TRUE(cache->Prepare(nullptr).ok());
  for (uint64_t at = 0; at < 8; ++at) {
    EXPECT_EQ(At(*cache, cache->k(), 0, at), 0.0f);
    EXPECT_EQ(At(*cache, cache->v(), 1, at), 0.0f);
  }
  cache->EndStep(/*commit=*/true);
}

TEST_F(KVCacheTest, Bfloat16StorageBytes) {
  KVCacheConfig config = Flat(4, 64);
  config.dtype = blob::DType::kBfloat16;
  std::unique_ptr<KVCache> cache = Make(config);
  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  ASSERT_TRUE(cache->Prepare(nullptr).ok());
  cache->EndStep(/*commit=*/true);
  EXPECT_EQ(cache->metrics().bytes_reserved, 2u * 1 * 2 * 4 * 4 * 2);
}

TEST_F(KVCacheTest, ReleasesStorageAtDestruction) {
  {
    std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
    Step(*cache, 5);
    EXPECT_EQ(record_.allocations_live, 2);
  }
  EXPECT_EQ(record_.allocations_live, 0);
  EXPECT_EQ(record_.synchronizations, 1);  // drained its last use first
}

TEST_F(KVCacheTest, AGrowthPreparedAheadAllocatesAndZeroesNothingAndKeepsContents) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  StreamHandle stream = &record_;
  Step(*cache, 2, stream);
  const uint64_t position_bytes = 2 * 4 * sizeof(float);  // heads * head_dim, one of K and V
  void* const k = cache->k();
  void* const v = cache->v();
  const int allocated = record_.async_allocations;
  const int zeroed = record_.zeroings;
  CacheStorage reserve;
  EXPECT_FALSE(cache->Reserve(&reserve));

  bool prepared = false;
  size_t copies = record_.copies.size();
  StepPreparingGrowth(*cache, 1, /*lookahead=*/3, stream, &prepared);  // 2 committed + 3 > 4
  EXPECT_TRUE(prepared);
  // The 2 committed positions of K and V are carried into the reserve now.
  ASSERT_EQ(record_.copies.size(), copies + 2);
  for (size_t copy = copies; copy < copies + 2; ++copy) {
    EXPECT_EQ(record_.copies[copy].bytes, 2 * position_bytes) << copy;
  }
  ASSERT_TRUE(cache->Reserve(&reserve));  // what an engine can be readied for, before the growth
  EXPECT_EQ(static_cast<const float*>(reserve.k)[4], 2.0f);  // row 0, position 1: carried
  EXPECT_NE(reserve.k, nullptr);
  EXPECT_NE(reserve.v, nullptr);
  EXPECT_NE(reserve.k, k);
  EXPECT_EQ(reserve.shape, (std::vector<int64_t>{1, 2, 8, 4}));
  EXPECT_EQ(reserve.bytes_per_tensor, position_bytes * 8);
  EXPECT_EQ(record_.async_allocations, allocated + 2);  // K and V at 8 positions, zeroed
  EXPECT_EQ(record_.zeroings, zeroed + 2);
  EXPECT_EQ(cache->k(), k);  // nothing a step binds changed
  EXPECT_EQ(cache->v(), v);
  EXPECT_EQ(cache->shape(), (std::vector<int64_t>{1, 2, 4, 4}));
  EXPECT_EQ(cache->metrics().capacity, 4u);
  EXPECT_EQ(cache->metrics().bytes_reserved, 2 * position_bytes * (4 + 8));  // memory held now

  // One reserve at a time: the next step within the lookahead allocates nothing more.
  StepPreparingGrowth(*cache, 1, /*lookahead=*/3, stream, &prepared);
  EXPECT_FALSE(prepared);
  EXPECT_EQ(record_.async_allocations, allocated + 2);

  // The growth to 8 takes the reserve: only the positions committed since carried in (2 and 3), no
  // allocation, no zeroing.
  copies = record_.copies.size();
  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  ASSERT_TRUE(cache->Prepare(stream).ok());
  EXPECT_EQ(record_.async_allocations, allocated + 2);
  EXPECT_EQ(record_.zeroings, zeroed + 2);
  ASSERT_EQ(record_.copies.size(), copies + 2);
  for (size_t copy = copies; copy < copies + 2; ++copy) {
    EXPECT_EQ(record_.copies[copy].bytes, 2 * position_bytes) << copy;
  }
  EXPECT_EQ(record_.allocations_live, 4);  // the old storage retired, not released
  EXPECT_EQ(cache->shape(), reserve.shape);
  EXPECT_EQ(cache->k(), reserve.k);  // the growth binds exactly what Reserve reported
  EXPECT_EQ(cache->v(), reserve.v);
  EXPECT_EQ(cache->bytes_per_tensor(), reserve.bytes_per_tensor);
  EXPECT_FALSE(cache->Reserve(&reserve));
  for (int64_t row = 0; row < 2; ++row) {
    for (uint64_t at = 0; at < 8; ++at) {
      const float expected = at < 4 ? static_cast<float>(at + 1) : 0.0f;
      EXPECT_EQ(At(*cache, cache->k(), row, at), expected) << row << " " << at;
      EXPECT_EQ(At(*cache, cache->v(), row, at), -expected) << row << " " << at;
    }
  }
  bool released = true;
  ASSERT_TRUE(cache->ReleaseRetired(stream, &released).ok());
  EXPECT_FALSE(released);  // never in the growth's own step
  ASSERT_TRUE(cache->MarkUsed(stream).ok());
  cache->EndStep(/*commit=*/true);
  KVCacheMetrics metrics = cache->metrics();
  EXPECT_EQ(metrics.growths, 1u);
  EXPECT_EQ(metrics.bytes_moved, 2 * position_bytes * 4);
  EXPECT_EQ(metrics.bytes_reserved, 2 * position_bytes * (8 + 4));  // the retired storage held

  // A later step releases it, on its stream, after its Prepare ordered that stream after the
  // growth.
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  EXPECT_FALSE(cache->ReleaseRetired(stream, &released).ok());  // not before the Prepare
  ASSERT_TRUE(cache->Prepare(stream).ok());
  const int waited = record_.stream_waits;
  const size_t frees = record_.async_frees.size();
  ASSERT_TRUE(cache->ReleaseRetired(stream, &released).ok());
  EXPECT_TRUE(released);
  EXPECT_EQ(record_.allocations_live, 2);
  ASSERT_EQ(record_.async_frees.size(), frees + 2);
  for (size_t free = frees; free < frees + 2; ++free) {
    EXPECT_EQ(record_.async_frees[free].stream, stream);
    EXPECT_EQ(record_.async_frees[free].stream_waits, waited);
  }
  ASSERT_TRUE(cache->ReleaseRetired(stream, &released).ok());
  EXPECT_FALSE(released);  // nothing left
  ASSERT_TRUE(cache->MarkUsed(stream).ok());
  cache->EndStep(/*commit=*/true);
  EXPECT_EQ(cache->metrics().bytes_reserved, 2 * position_bytes * 8);
}

// What a growth onto the reserve retired is released by the next growth if no step released it, and
// with the cache; a growth that allocates releases the old storage at once; and a release outside a
// step is refused (nothing would order it after the storage's last use).
TEST_F(KVCacheTest, RetiredStorageNeverOutlivesTheNextGrowthOrTheCache) {
  {
    std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
    bool released = false;
    EXPECT_FALSE(cache->ReleaseRetired(nullptr, &released).ok());
    ASSERT_TRUE(cache->BeginReset().ok());
    EXPECT_FALSE(cache->ReleaseRetired(nullptr, &released).ok());  // a reset holds no stream
    cache->EndReset(/*reset=*/false);
    Step(*cache, 3);
    bool prepared = false;
    StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);
    ASSERT_TRUE(prepared);
    StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);  // grows onto it, to 8
    EXPECT_EQ(cache->metrics().capacity, 8u);
    EXPECT_EQ(record_.allocations_live, 4);  // 8 and the retired 4
    for (int step = 0; step < 3; ++step) {
      StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);
    }
    CacheStorage reserve;
    ASSERT_TRUE(cache->Reserve(&reserve));
    EXPECT_EQ(reserve.shape[2], 16);
    EXPECT_EQ(record_.allocations_live, 6);
    Step(*cache, 1);  // grows onto it, to 16: the storage at 4 goes, the one at 8 is retired
    EXPECT_EQ(cache->metrics().capacity, 16u);
    EXPECT_EQ(record_.allocations_live, 4);
    EXPECT_EQ(cache->metrics().bytes_reserved, 2u * 2 * 4 * sizeof(float) * (16 + 8));
    Step(*cache, 20);  // allocates 32 (no reserve there): 16 goes at once, and 8 with the growth
    EXPECT_EQ(cache->metrics().capacity, 32u);
    EXPECT_EQ(record_.allocations_live, 2);
    for (uint64_t at = 0; at < 32; ++at) {
      EXPECT_EQ(At(*cache, cache->k(), 1, at), at < 29 ? at + 1.0f : 0.0f) << at;
    }
    for (int step = 0; step < 3; ++step) {
      StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);
    }
    ASSERT_TRUE(cache->Reserve(&reserve));
    Step(*cache, 1);  // onto the reserve at 64
    EXPECT_EQ(cache->metrics().capacity, 64u);
    EXPECT_EQ(record_.allocations_live, 4);
  }
  EXPECT_EQ(record_.allocations_live, 0);
}

TEST_F(KVCacheTest, AReserveOfAnotherCapacityIsReleasedAndTheGrowthKeepsContents) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  Step(*cache, 3);
  bool prepared = false;
  StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);
  ASSERT_TRUE(prepared);  // at 8 positions
  EXPECT_EQ(record_.allocations_live, 4);

  // A step of 5 after 4 needs 16 positions: the reserve at 8 is released, the growth allocates.
  const int allocated = record_.async_allocations;
  Step(*cache, 5);
  EXPECT_EQ(record_.async_allocations, allocated + 2);
  EXPECT_EQ(record_.allocations_live, 2);  // no leak: the reserve and the old storage are gone
  const KVCacheMetrics metrics = cache->metrics();
  EXPECT_EQ(metrics.capacity, 16u);
  EXPECT_EQ(metrics.bytes_reserved, 2u * 2 * 4 * sizeof(float) * 16);
  for (uint64_t at = 0; at < 16; ++at) {
    const float expected = at < 9 ? static_cast<float>(at + 1) : 0.0f;
    EXPECT_EQ(At(*cache, cache->k(), 1, at), expected) << at;
    EXPECT_EQ(At(*cache, cache->v(), 0, at), -expected) << at;
  }
}

TEST_F(KVCacheTest, OnlyAFlatCacheBelowItsMaxReservesAndOnlyWithinTheLookahead) {
  bool prepared = true;
  uint64_t position = 0;
  // Outside a step there is no stream ordering the reserve before the next use.
  std::unique_ptr<KVCache> flat = Make(Flat(4, 6));
  Step(*flat, 1);
  Status outside = flat->PrepareGrowth(/*lookahead=*/8, nullptr, &prepared);
  EXPECT_EQ(outside.code(), Error::Internal);
  EXPECT_FALSE(prepared);
  const int allocated = record_.async_allocations;
  ASSERT_TRUE(flat->BeginStep(1, &position).ok());
  ASSERT_TRUE(flat->Prepare(nullptr).ok());
  ASSERT_TRUE(flat->PrepareGrowth(/*lookahead=*/3, nullptr, &prepared).ok());  // 1 + 3 <= 4
  EXPECT_FALSE(prepared);
  EXPECT_EQ(record_.async_allocations, allocated);
  ASSERT_TRUE(flat->PrepareGrowth(/*lookahead=*/4, nullptr, &prepared).ok());
  EXPECT_TRUE(prepared);  // at the max of 6, not 8
  EXPECT_EQ(flat->metrics().bytes_reserved, 2u * 2 * 4 * sizeof(float) * (4 + 6));
  flat->EndStep(/*commit=*/true);
  Step(*flat, 4);  // grows to 6 through the reserve
  EXPECT_EQ(record_.async_allocations, allocated + 2);
  EXPECT_EQ(flat->metrics().capacity, 6u);
  // At max_capacity there is no next capacity.
  ASSERT_TRUE(flat->BeginStep(0, &position).ok());
  ASSERT_TRUE(flat->Prepare(nullptr).ok());
  ASSERT_TRUE(flat->PrepareGrowth(/*lookahead=*/100, nullptr, &prepared).ok());
  EXPECT_FALSE(prepared);
  flat->EndStep(/*commit=*/false);

  // A ring never grows.
  std::unique_ptr<KVCache> ring = Make(Ring(6));
  Step(*ring, 5);
  ASSERT_TRUE(ring->BeginStep(1, &position).ok());
  ASSERT_TRUE(ring->Prepare(nullptr).ok());
  ASSERT_TRUE(ring->PrepareGrowth(/*lookahead=*/100, nullptr, &prepared).ok());
  EXPECT_FALSE(prepared);
  ring->EndStep(/*commit=*/true);
  EXPECT_EQ(record_.async_allocations, allocated + 4);  // the ring's own K and V only
  EXPECT_EQ(ring->metrics().bytes_reserved, 2u * 2 * 4 * sizeof(float) * 6);
}

TEST_F(KVCacheTest, AFailedReservationLeavesTheCacheFullyUsable) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  Step(*cache, 3);
  void* const k = cache->k();
  const int live = record_.allocations_live;
  for (int failing : {1, 2}) {  // K's reserve fails; V's fails after K's succeeded
    record_.fail_async_allocation_in = failing;
    uint64_t position = 0;
    ASSERT_TRUE(cache->BeginStep(1, &position).ok());
    ASSERT_TRUE(cache->Prepare(nullptr).ok());
    bool prepared = true;
    Status status = cache->PrepareGrowth(/*lookahead=*/4, nullptr, &prepared);
    cache->EndStep(/*commit=*/false);
    EXPECT_EQ(status.code(), Error::MemoryAllocationFailed);
    EXPECT_NE(status.message().find("preparing a KV cache's growth to 8 positions"),
              std::string::npos)
        << status.message();
    EXPECT_FALSE(prepared);
    EXPECT_EQ(record_.allocations_live, live);  // K's reserve released with V's failure
    EXPECT_EQ(cache->k(), k);
    EXPECT_EQ(cache->metrics().bytes_reserved, 2u * 2 * 4 * sizeof(float) * 4);
  }
  // The growth allocates as it would have without a reserve; the contents survive it.
  for (int token = 0; token < 6; ++token) Step(*cache, 1);
  EXPECT_EQ(cache->metrics().capacity, 16u);
  EXPECT_EQ(record_.allocations_live, 2);
  for (uint64_t at = 0; at < 9; ++at) EXPECT_EQ(At(*cache, cache->k(), 0, at), at + 1.0f) << at;
}

TEST_F(KVCacheTest, AResetKeepsTheReserveAndDestructionReleasesIt) {
  {
    std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
    Step(*cache, 3);
    bool prepared = false;
    StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);
    ASSERT_TRUE(prepared);
    ASSERT_TRUE(cache->BeginReset().ok());
    cache->EndReset(/*reset=*/true);
    EXPECT_EQ(cache->metrics().bytes_reserved, 2u * 2 * 4 * sizeof(float) * (4 + 8));
    const int allocated = record_.async_allocations;
    Step(*cache, 6);  // grows into the kept reserve
    EXPECT_EQ(record_.async_allocations, allocated);
    EXPECT_EQ(cache->metrics().capacity, 8u);
    for (uint64_t at = 0; at < 8; ++at) {
      EXPECT_EQ(At(*cache, cache->k(), 1, at), at < 6 ? at + 1.0f : 0.0f) << at;
    }
    StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);
    ASSERT_TRUE(prepared);  // at 16, held when the cache goes
    EXPECT_EQ(record_.allocations_live, 6);  // with the storage at 4 the growth retired
  }
  EXPECT_EQ(record_.allocations_live, 0);
}

// A step whose Prepare did not run still leaves the last use covering every earlier one: its
// MarkUsed orders the stream after the last use before recording it. Without that, a later step
// could release or overwrite storage an earlier step on another stream still reads.
TEST_F(KVCacheTest, AMarkWithoutAPrepareStillCoversTheLastUse) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  int other_stream = 0;
  Step(*cache, 1, &record_);
  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  bool prepared = false;
  EXPECT_FALSE(cache->PrepareGrowth(4, &other_stream, &prepared).ok());  // not before the Prepare
  const int waited = record_.stream_waits;
  ASSERT_TRUE(cache->MarkUsed(&other_stream).ok());
  EXPECT_EQ(record_.stream_waits, waited + 1);
  cache->EndStep(/*commit=*/false);
  // A prepared step does not wait twice.
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  ASSERT_TRUE(cache->Prepare(&other_stream).ok());
  const int prepared_waits = record_.stream_waits;
  ASSERT_TRUE(cache->MarkUsed(&other_stream).ok());
  EXPECT_EQ(record_.stream_waits, prepared_waits);
  cache->EndStep(/*commit=*/true);
}

// A reset forgets the positions carried into the reserve: a later growth into it copies every
// position again, so that what the reset forgot does not come back.
TEST_F(KVCacheTest, AResetForgetsThePositionsCarriedIntoTheReserve) {
  std::unique_ptr<KVCache> cache = Make(Flat(4, 64));
  Step(*cache, 3);
  bool prepared = false;
  StepPreparingGrowth(*cache, 1, /*lookahead=*/4, nullptr, &prepared);  // carries positions 0-2
  ASSERT_TRUE(prepared);
  ASSERT_TRUE(cache->BeginReset().ok());
  cache->EndReset(/*reset=*/true);
  Step(*cache, 1);  // position 0 again
  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(4, &position).ok());  // 1 + 4 > 4: grows into the reserve
  ASSERT_TRUE(cache->Prepare(nullptr).ok());
  EXPECT_EQ(cache->metrics().capacity, 8u);
  for (int64_t row = 0; row < 2; ++row) {
    EXPECT_EQ(At(*cache, cache->k(), row, 0), 1.0f) << row;
    for (uint64_t at = 1; at < 8; ++at) {
      EXPECT_EQ(At(*cache, cache->k(), row, at), 0.0f) << row << " " << at;
      EXPECT_EQ(At(*cache, cache->v(), row, at), 0.0f) << row << " " << at;
    }
  }
  cache->EndStep(/*commit=*/false);
}

TEST_F(KVCacheTest, ASequenceSharesByKeyAndRefusesAnotherLayout) {
  std::shared_ptr<Sequence> sequence = Sequence::Create();
  auto ops = std::make_shared<CountingDeviceOps>(&record_);
  std::shared_ptr<KVCache> prefill, decode, other;
  ASSERT_TRUE(sequence->Acquire("layers.0", Flat(4, 64), ops, &prefill).ok());
  ASSERT_TRUE(sequence->Acquire("layers.0", Flat(4, 64), ops, &decode).ok());
  EXPECT_EQ(prefill, decode);
  EXPECT_EQ(sequence->Find("layers.0"), prefill);
  Status mismatch = sequence->Acquire("layers.0", Flat(8, 64), ops, &other);
  EXPECT_EQ(mismatch.code(), Error::InvalidProgram);
  EXPECT_NE(mismatch.message().find("'layers.0' is already held"), std::string::npos);
  EXPECT_EQ(other, nullptr);
  ASSERT_TRUE(sequence->Acquire("layers.1", Flat(4, 64), ops, &other).ok());
  EXPECT_NE(other, prefill);
}

TEST_F(KVCacheTest, SequencesAreIsolatedAndResetAndMeasuredOnTheirOwn) {
  auto ops = std::make_shared<CountingDeviceOps>(&record_);
  std::shared_ptr<Sequence> a = Sequence::Create(), b = Sequence::Create();
  EXPECT_NE(a->id(), b->id());
  std::shared_ptr<KVCache> a0, a1, b0;
  ASSERT_TRUE(a->Acquire("layers.0", Flat(4, 64), ops, &a0).ok());
  ASSERT_TRUE(a->Acquire("layers.1", Flat(4, 64), ops, &a1).ok());
  ASSERT_TRUE(b->Acquire("layers.0", Flat(4, 64), ops, &b0).ok());
  EXPECT_NE(a0, b0);
  Step(*a0, 5);
  Step(*a1, 5);
  Step(*b0, 2);
  size_t caches = 0;
  KVCacheMetrics metrics = a->Metrics(&caches);
  EXPECT_EQ(caches, 2u);
  EXPECT_EQ(metrics.length, 10u);  // summed over the layers
  EXPECT_EQ(metrics.position, 10u);
  EXPECT_EQ(b->Metrics(&caches).length, 2u);
  EXPECT_EQ(caches, 1u);

  ASSERT_TRUE(a->Reset().ok());
  EXPECT_EQ(a->Metrics().length, 0u);
  EXPECT_EQ(b->Metrics().length, 2u);

  // A reset while a step holds one cache resets none of them.
  Step(*a0, 3);
  Step(*a1, 3);
  uint64_t position = 0;
  ASSERT_TRUE(a1->BeginStep(1, &position).ok());
  Status refused = a->Reset();
  EXPECT_EQ(refused.code(), Error::InvalidState);
  EXPECT_NE(refused.message().find("'layers.1'"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("nothing was reset"), std::string::npos) << refused.message();
  EXPECT_EQ(a0->metrics().length, 3u);
  a1->EndStep(/*commit=*/true);
  EXPECT_EQ(a1->metrics().length, 4u);
  Step(*a0, 1);  // layers.0 was released by the refused reset
}

TEST_F(KVCacheTest, TheImplicitSequenceRefusesASecondInstanceOfAMethodAnExplicitOneDoesNot) {
  std::shared_ptr<Sequence> implicit = Sequence::Implicit();
  EXPECT_EQ(Sequence::Implicit(), implicit);
  EXPECT_EQ(Sequence::FindImplicit(), implicit);
  ASSERT_TRUE(implicit->Claim("prefill", "k+v").ok());
  ASSERT_TRUE(implicit->Claim("decode", "k+v").ok());  // one program's methods share
  Status second = implicit->Claim("decode", "k+v");
  EXPECT_EQ(second.code(), Error::InvalidState);
  EXPECT_NE(second.message().find("second loaded instance"), std::string::npos) << second.message();
  implicit->Release("decode", "k+v");
  EXPECT_TRUE(implicit->Claim("decode", "k+v").ok());  // the first instance is gone

  std::shared_ptr<Sequence> shared = Sequence::Create();  // the caller asked for sharing
  ASSERT_TRUE(shared->Claim("decode", "k+v").ok());
  EXPECT_TRUE(shared->Claim("decode", "k+v").ok());

  const uint64_t id = implicit->id();
  implicit.reset();
  EXPECT_EQ(Sequence::FindImplicit(), nullptr);  // it lives while someone holds it
  EXPECT_NE(Sequence::Implicit()->id(), id);
}

TEST_F(KVCacheTest, SequenceGuardsNestPerThread) {
  std::shared_ptr<Sequence> a = Sequence::Create(), b = Sequence::Create();
  EXPECT_EQ(CurrentSequence(), nullptr);
  {
    SequenceGuard outer(a);
    EXPECT_EQ(CurrentSequence(), a);
    {
      SequenceGuard inner(b);
      EXPECT_EQ(CurrentSequence(), b);
    }
    EXPECT_EQ(CurrentSequence(), a);
  }
  EXPECT_EQ(CurrentSequence(), nullptr);
}

TEST_F(KVCacheTest, TheCApiSelectsMeasuresAndResetsSequences) {
  ZeroKVSequence* handle = zerokv_kv_sequence_create();
  ASSERT_NE(handle, nullptr);
  zerokv_kv_sequence_select(handle);
  std::shared_ptr<Sequence> sequence = CurrentSequence();
  ASSERT_NE(sequence, nullptr);
  zerokv_kv_sequence_select(nullptr);
  EXPECT_EQ(CurrentSequence(), nullptr);

  ZeroKVCacheMetrics metrics{};
  EXPECT_EQ(zerokv_kv_sequence_metrics(handle, &metrics), 0);
  std::shared_ptr<KVCache> cache;
  ASSERT_TRUE(sequence->Acquire("layers.0", Flat(4, 64), std::make_shared<CountingDeviceOps>(&record_),
                                &cache)
                  .ok());
  Step(*cache, 5);
  ASSERT_EQ(zerokv_kv_sequence_metrics(handle, &metrics), 1);
  EXPECT_EQ(metrics.length, 5u);
  EXPECT_EQ(metrics.position, 5u);
  EXPECT_EQ(metrics.capacity, 8u);  // a first step of 5 allocates 8 positions at once
  EXPECT_EQ(metrics.growths, 0u);

  uint64_t position = 0;
  ASSERT_TRUE(cache->BeginStep(1, &position).ok());
  EXPECT_EQ(zerokv_kv_sequence_reset(handle), -1);  // a step is in flight
  cache->EndStep(/*commit=*/true);
  EXPECT_EQ(zerokv_kv_sequence_reset(handle), 0);
  ASSERT_EQ(zerokv_kv_sequence_metrics(handle, &metrics), 1);
  EXPECT_EQ(metrics.length, 0u);

  // The handle is one reference among others.
  zerokv_kv_sequence_release(handle);
  EXPECT_EQ(sequence->Find("layers.0"), cache);
}

}  // namespace
}  // namespace zerokv::kvcache
