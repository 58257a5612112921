// The TensorRT adapter's checks without TensorRT: profile selection over shape ranges (a
// decode + prefill plan), the 256-byte address alignment, and output sizes against their buffers.
#include "cc/engines/tensorrt/binding_checks.h"

#include <cstdint>
#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace zerokv::engines::tensorrt {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// The two profiles zerokv's lowering builds for a decoder: decode [1, 1] and prefill [1, 1..16];
// the cache is static in both.
std::vector<ProfileRanges> DecodeAndPrefill() {
  const ShapeRange cache{{1, 2, 32, 16}, {1, 2, 32, 16}};
  return {
      {{"input_ids", {{1, 1}, {1, 1}}}, {"k_cache", cache}},
      {{"input_ids", {{1, 1}, {1, 16}}}, {"k_cache", cache}},
  };
}

std::map<std::string, std::vector<int64_t>> Query(int64_t length) {
  return {{"input_ids", {1, length}}, {"k_cache", {1, 2, 32, 16}}};
}

TEST(SelectProfile, APrefillRunsOnThePrefillProfile) {
  int selected = -1;
  ASSERT_TRUE(SelectProfile(DecodeAndPrefill(), Query(7), /*current=*/0, &selected).ok());
  EXPECT_EQ(selected, 1);
  ASSERT_TRUE(SelectProfile(DecodeAndPrefill(), Query(16), /*current=*/0, &selected).ok());
  EXPECT_EQ(selected, 1);
}

TEST(SelectProfile, KeepsTheCurrentProfileWhenItAdmitsTheShapes) {
  int selected = -1;
  ASSERT_TRUE(SelectProfile(DecodeAndPrefill(), Query(1), /*current=*/1, &selected).ok());
  EXPECT_EQ(selected, 1);
  ASSERT_TRUE(SelectProfile(DecodeAndPrefill(), Query(1), /*current=*/0, &selected).ok());
  EXPECT_EQ(selected, 0);
}

TEST(SelectProfile, RefusesShapesNoProfileAdmitsNamingTheInputAndEachRange) {
  int selected = -1;
  Status status = SelectProfile(DecodeAndPrefill(), Query(17), /*current=*/0, &selected);
  EXPECT_EQ(status.code(), executorch::runtime::Error::InvalidArgument);
  EXPECT_THAT(
      status.message(),
      AllOf(HasSubstr("profile 0 admits input 'input_ids' in [1, 1]..[1, 1], not [1, 17]"),
            HasSubstr("profile 1 admits input 'input_ids' in [1, 1]..[1, 16], not [1, 17]")));
  EXPECT_EQ(selected, -1);
}

TEST(SelectProfile, RefusesAWrongRank) {
  int selected = -1;
  auto shapes = Query(1);
  shapes["input_ids"] = {1, 1, 1};
  Status status = SelectProfile(DecodeAndPrefill(), shapes, 0, &selected);
  EXPECT_THAT(status.message(), HasSubstr("not [1, 1, 1]"));
}

TEST(SelectProfile, RefusesAMissingOrUnknownInput) {
  int selected = -1;
  auto missing = Query(1);
  missing.erase("k_cache");
  EXPECT_THAT(SelectProfile(DecodeAndPrefill(), missing, 0, &selected).message(),
              HasSubstr("input 'k_cache' has no shape for this run"));
  auto unknown = Query(1);
  unknown["v_cache"] = {1};
  EXPECT_THAT(SelectProfile(DecodeAndPrefill(), unknown, 0, &selected).message(),
              HasSubstr("'v_cache' is not an input of the TensorRT engine"));
  EXPECT_THAT(SelectProfile({}, Query(1), 0, &selected).message(),
              HasSubstr("no optimization profile"));
}

TEST(CheckAddressAlignment, Takes256ByteAlignedAddressesOnly) {
  alignas(kTensorAddressAlignment) static char arena[2 * kTensorAddressAlignment];
  EXPECT_TRUE(CheckAddressAlignment("k_cache", arena).ok());
  EXPECT_TRUE(CheckAddressAlignment("k_cache", arena + kTensorAddressAlignment).ok());
  EXPECT_TRUE(CheckAddressAlignment("empty", nullptr).ok());
  // ExecuTorch's default planning alignment: 16 bytes.
  Status status = CheckAddressAlignment("input_ids", arena + 16);
  EXPECT_EQ(status.code(), executorch::runtime::Error::InvalidArgument);
  EXPECT_THAT(status.message(),
              AllOf(HasSubstr("binding 'input_ids'"), HasSubstr("16 bytes past a 256-byte"),
                    HasSubstr("alignment=256")));
}

TEST(CheckOutputFits, TakesAnOutputUpToItsBuffer) {
  EXPECT_TRUE(CheckOutputFits("logits", {1, 7, 64}, 4, 7 * 64 * 4).ok());
  EXPECT_TRUE(CheckOutputFits("logits", {1, 1, 64}, 4, 16 * 64 * 4).ok());
  EXPECT_TRUE(CheckOutputFits("empty", {1, 0, 64}, 4, 0).ok());
}

TEST(CheckOutputFits, RefusesAnOutputLargerThanItsBuffer) {
  Status status = CheckOutputFits("logits", {1, 8, 64}, 4, 7 * 64 * 4);
  EXPECT_EQ(status.code(), executorch::runtime::Error::InvalidArgument);
  EXPECT_THAT(status.message(),
              AllOf(HasSubstr("output 'logits' of shape [1, 8, 64] needs 2048 bytes"),
                    HasSubstr("holds 1792")));
}

TEST(CheckOutputFits, RefusesADataDependentShape) {
  EXPECT_THAT(CheckOutputFits("nonzero", {-1, 2}, 8, 1 << 20).message(),
              AllOf(HasSubstr("output 'nonzero' has shape [-1, 2]"), HasSubstr("data-dependent")));
}

TEST(CheckOutputFits, RefusesAShapeWhoseBytesOverflow) {
  const int64_t huge = std::numeric_limits<int64_t>::max();
  const size_t any = std::numeric_limits<size_t>::max();
  EXPECT_THAT(CheckOutputFits("logits", {huge, huge}, 4, any).message(),
              HasSubstr("more bytes than memory can address"));
}

}  // namespace
}  // namespace zerokv::engines::tensorrt
