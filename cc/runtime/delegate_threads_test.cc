// Delegates on several threads at once: different sequences decode concurrently and stay apart;
// steps of one sequence never interleave, and a reset never lands inside one. Built plain and
// under ThreadSanitizer (delegate_threads_tsan_test), which reports any data race in the runtime,
// the caches or the sequences.
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cc/base/testing/counting_device_ops.h"
#include "cc/kvcache/sequence.h"
#include "cc/runtime/delegate.h"
#include "cc/runtime/testing/et_tensor.h"
#include "cc/runtime/testing/runtime_kv_model.h"

namespace zerokv::runtime {
namespace {

using executorch::aten::ScalarType;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::Span;
using kvcache::Sequence;
using kvcache::SequenceGuard;
using base::testing::CountingDeviceOps;
using testing::OwnedTensor;
using testing::RuntimeKvBlob;
using testing::RuntimeKvEngine;
using ET = executorch::runtime::etensor::DeviceType;

constexpr int kSteps = 150;
constexpr uint64_t kMaxCapacity = 2 * kSteps;  // room for both threads of one sequence

// One loaded instance of the program's "decode" delegate, at home in `home`, run by one thread.
// Its arguments are host-resident, so each step also stages. `record` must outlive the sequence
// (its caches keep the device ops they were created with).
struct Instance {
  Instance(const std::string& key, std::shared_ptr<Sequence> home, CountingDeviceOps::Record* record) {
    SequenceGuard guard(std::move(home));
    const blob::Blob blob = RuntimeKvBlob(key, 4, kMaxCapacity);
    status = Delegate::Create(blob, RuntimeKvEngine(blob), std::make_unique<CountingDeviceOps>(record),
                              "decode", &delegate);
  }

  // One token; the caller's position is wrong on purpose. Returns the count of positions the
  // model saw filled (logits[0]) or -1 when the step was refused, with why in `refused`.
  float Step() {
    OwnedTensor<int64_t> tokens(ScalarType::Long, {1, 1}, ET::CPU);
    OwnedTensor<int64_t> position(ScalarType::Long, {1}, ET::CPU);
    position.data()[0] = 12345;
    OwnedTensor<float> logits(ScalarType::Float, {1, 4, 3}, ET::CPU);
    EValue* args[] = {tokens.value(), position.value(), logits.value()};
    Status status = delegate->Execute(Span<EValue*>(args, 3));
    if (!status.ok()) {
      refused = status;
      return -1.0f;
    }
    return logits.data()[0];
  }

  std::unique_ptr<Delegate> delegate;
  Status status;
  Status refused;
};

// K's first row of the sequence's cache of `key`, over its whole capacity.
std::vector<float> FirstRow(const Sequence& sequence, const std::string& key) {
  std::shared_ptr<kvcache::KVCache> cache = sequence.Find(key);
  const std::vector<int64_t> shape = cache->shape();
  const auto* k = static_cast<const float*>(cache->k());
  std::vector<float> row;
  for (int64_t position = 0; position < shape[2]; ++position) row.push_back(k[position * shape[3]]);
  return row;
}

TEST(DelegateThreadsTest, TwoThreadsDecodeDifferentSequencesAtOnce) {
  const std::string key = "threads.isolated";
  CountingDeviceOps::Record records[2];
  std::shared_ptr<Sequence> a = Sequence::Create(), b = Sequence::Create();
  Instance first(key, a, &records[0]), second(key, b, &records[1]);
  ASSERT_TRUE(first.status.ok()) << first.status.message();
  ASSERT_TRUE(second.status.ok()) << second.status.message();

  std::atomic<bool> done{false};
  std::vector<int> wrong(2, 0);
  auto decode = [&](Instance& instance, int index) {
    for (int step = 0; step < kSteps; ++step) {
      // Each step sees exactly its own sequence's earlier positions and itself.
      if (instance.Step() != static_cast<float>(step + 1)) ++wrong[index];
    }
  };
  // Metrics are read from a third thread meanwhile, as a monitoring runner would.
  std::thread reader([&] {
    while (!done) (void)a->Metrics(), (void)b->Metrics();
  });
  std::thread one(decode, std::ref(first), 0), two(decode, std::ref(second), 1);
  one.join();
  two.join();
  done = true;
  reader.join();

  EXPECT_EQ(wrong, (std::vector<int>{0, 0}));
  for (const std::shared_ptr<Sequence>& sequence : {a, b}) {
    EXPECT_EQ(sequence->Metrics().length, static_cast<uint64_t>(kSteps));
    const std::vector<float> row = FirstRow(*sequence, key);
    for (int position = 0; position < kSteps; ++position) {
      ASSERT_EQ(row[position], static_cast<float>(position + 1)) << position;
    }
  }
}

// Two delegates at home in one sequence (the caller asked them to share it) step from two threads:
// a step that finds the caches held by the other's is refused, the others commit one after the
// other, so the positions hold every committed token once, with no gap.
TEST(DelegateThreadsTest, StepsOfOneSequenceNeverInterleave) {
  const std::string key = "threads.shared";
  CountingDeviceOps::Record records[2];
  std::shared_ptr<Sequence> shared = Sequence::Create();
  Instance first(key, shared, &records[0]), second(key, shared, &records[1]);
  ASSERT_TRUE(first.status.ok()) << first.status.message();
  ASSERT_TRUE(second.status.ok()) << second.status.message();

  std::vector<int> committed(2, 0), unexpected(2, 0);
  auto decode = [&](Instance& instance, int index) {
    for (int step = 0; step < kSteps; ++step) {
      if (instance.Step() >= 0) {
        ++committed[index];
      } else if (instance.refused.code() != Error::InvalidState) {
        ++unexpected[index];
      }
    }
  };
  std::thread one(decode, std::ref(first), 0), two(decode, std::ref(second), 1);
  one.join();
  two.join();

  EXPECT_EQ(unexpected, (std::vector<int>{0, 0})) << first.refused.message() << " / "
                                                  << second.refused.message();
  const uint64_t total = static_cast<uint64_t>(committed[0] + committed[1]);
  EXPECT_EQ(shared->Metrics().length, total);
  const std::vector<float> row = FirstRow(*shared, key);
  for (uint64_t position = 0; position < row.size(); ++position) {
    ASSERT_EQ(row[position], position < total ? static_cast<float>(position + 1) : 0.0f) << position;
  }
}

// A thread resets the sequence while another decodes on it: each reset either lands between two
// steps or is refused, so the cache always holds positions 0..length-1 of the current run, and
// zeros after them.
TEST(DelegateThreadsTest, ResetsRacingStepsLandBetweenThem) {
  const std::string key = "threads.reset";
  CountingDeviceOps::Record record;
  std::shared_ptr<Sequence> sequence = Sequence::Create();
  Instance instance(key, sequence, &record);
  ASSERT_TRUE(instance.status.ok()) << instance.status.message();

  std::atomic<bool> started{false}, done{false};
  int resets = 0, refused_resets = 0;
  std::thread resetter([&] {
    while (!done) {
      (sequence->Reset().ok() ? resets : refused_resets) += 1;
      started = true;
    }
  });
  // On a busy machine the steps could all be over before the resetter first runs.
  while (!started) std::this_thread::yield();
  int wrong = 0, refused_steps = 0;
  for (int step = 0; step < kSteps; ++step) {
    const float seen = instance.Step();
    if (seen < 0 && instance.refused.code() == Error::InvalidState) {
      ++refused_steps;  // the reset held the caches at that moment: the caller may retry
    } else if (seen < 1.0f || seen > static_cast<float>(kSteps)) {
      ++wrong;  // a step saw a gap's worth of positions, or failed otherwise
    }
    std::this_thread::yield();  // between steps is where a reset may land
  }
  done = true;
  resetter.join();
  EXPECT_EQ(wrong, 0) << instance.refused.message();
  EXPECT_GT(resets + refused_resets, 0);
  std::printf("%d resets landed, %d refused; %d steps refused\n", resets, refused_resets,
              refused_steps);

  const uint64_t length = sequence->Metrics().length;
  const std::vector<float> row = FirstRow(*sequence, key);
  if (length == 0) return;  // reset last: its zeroing waits for the next step
  for (uint64_t position = 0; position < row.size(); ++position) {
    ASSERT_EQ(row[position], position < length ? static_cast<float>(position + 1) : 0.0f)
        << position << " of " << length;
  }
}

}  // namespace
}  // namespace zerokv::runtime
