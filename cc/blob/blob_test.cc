#include "cc/blob/blob.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "cc/blob/example_blob.h"

namespace zerokv::blob {
namespace {

std::string FixtureDir() {
  const char* dir = std::getenv("BLOB_FIXTURES");
  return dir ? dir : "";
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct FixtureCase {
  std::string name;
  std::string expected;  // "OK", "OK=<case it parses like>" or an ErrorCodeName
};

// The cases of tests/blob/make_fixtures.py, read from its MANIFEST.
std::vector<FixtureCase> ReadManifest() {
  std::vector<FixtureCase> cases;
  std::ifstream manifest(FixtureDir() + "/MANIFEST");
  for (std::string name, expected; manifest >> name >> expected;) cases.push_back({name, expected});
  return cases;
}

// The parsed blob's payload points into `bytes`, which must outlive it (hence no temporaries).
Blob MustParse(const std::vector<uint8_t>& bytes) {
  Blob blob;
  std::optional<Error> error = Parse(bytes.data(), bytes.size(), &blob);
  EXPECT_FALSE(error.has_value()) << error->message;
  return blob;
}

Blob MustParse(std::vector<uint8_t>&& bytes) = delete;

std::vector<uint8_t> MustSerialize(const Blob& blob) {
  std::vector<uint8_t> bytes;
  std::optional<Error> error = Serialize(blob, &bytes);
  EXPECT_FALSE(error.has_value()) << error->message;
  return bytes;
}

class FixtureTest : public ::testing::TestWithParam<FixtureCase> {};

// Each rejection rule has at least one fixture that breaks only that rule.
TEST_P(FixtureTest, ParsesOrRefusesWithTheExpectedCode) {
  const FixtureCase& fixture = GetParam();
  const std::vector<uint8_t> bytes = ReadFile(FixtureDir() + "/" + fixture.name + ".blob");
  Blob blob;
  std::optional<Error> error = Parse(bytes.data(), bytes.size(), &blob);
  if (fixture.expected == "OK") {
    ASSERT_FALSE(error.has_value()) << error->message;
    // What was parsed writes back to the same bytes, in the version it was written in.
    EXPECT_EQ(MustSerialize(blob), bytes);
    return;
  }
  if (fixture.expected.rfind("OK=", 0) == 0) {
    ASSERT_FALSE(error.has_value()) << error->message;
    // Fields a later writer added are skipped: the blob reads like the one without them.
    const std::vector<uint8_t> same_bytes = ReadFile(FixtureDir() + "/" + fixture.expected.substr(3) + ".blob");
    const Blob same = MustParse(same_bytes);
    EXPECT_EQ(blob.metadata, same.metadata);
    EXPECT_EQ(blob.format_version, same.format_version);
    EXPECT_EQ(blob.engine_kind, same.engine_kind);
    EXPECT_EQ(blob.aliased_outputs_elided, same.aliased_outputs_elided);
    EXPECT_EQ(std::vector<uint8_t>(blob.payload, blob.payload + blob.payload_size),
              std::vector<uint8_t>(same.payload, same.payload + same.payload_size));
    return;
  }
  ASSERT_TRUE(error.has_value()) << fixture.name << " was accepted";
  EXPECT_EQ(ErrorCodeName(error->code), fixture.expected) << error->message;
  EXPECT_NE(error->message.find(" at "), std::string::npos) << "the message names no field: " << error->message;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureTest, ::testing::ValuesIn(ReadManifest()),
                         [](const ::testing::TestParamInfo<FixtureCase>& info) { return info.param.name; });

TEST(FixturesTest, ManifestCoversEveryErrorCode) {
  const std::vector<FixtureCase> cases = ReadManifest();
  ASSERT_FALSE(cases.empty()) << "no MANIFEST under " << FixtureDir();
  for (int code = 1; std::string(ErrorCodeName(static_cast<ErrorCode>(code))) != "<invalid>"; ++code) {
    const std::string name = ErrorCodeName(static_cast<ErrorCode>(code));
    bool covered = false;
    for (const FixtureCase& fixture : cases) covered |= fixture.expected == name;
    EXPECT_TRUE(covered) << "no fixture refused with " << name;
  }
}

TEST(BlobTest, RoundTripsThroughTheWriter) {
  const Blob blob = testing::CallerKvBlob();
  const std::vector<uint8_t> bytes = MustSerialize(blob);
  const Blob parsed = MustParse(bytes);
  EXPECT_EQ(parsed.engine_kind, blob.engine_kind);
  EXPECT_EQ(parsed.device_id, blob.device_id);
  EXPECT_EQ(parsed.aliased_outputs_elided, blob.aliased_outputs_elided);
  EXPECT_EQ(parsed.metadata, blob.metadata);
  ASSERT_EQ(parsed.payload_size, blob.payload_size);
  EXPECT_EQ(std::vector<uint8_t>(parsed.payload, parsed.payload + parsed.payload_size), testing::ExamplePayload());
  EXPECT_EQ(static_cast<size_t>(parsed.payload - bytes.data()) % kPayloadAlignment, 0u);
}

TEST(BlobTest, ReadsWhatPythonWrote) {
  const std::vector<uint8_t> bytes = ReadFile(FixtureDir() + "/valid_caller_kv.blob");
  const Blob parsed = MustParse(bytes);
  const Blob expected = testing::CallerKvBlob();
  EXPECT_EQ(parsed.metadata, expected.metadata);
  EXPECT_EQ(parsed.engine_kind, expected.engine_kind);
  EXPECT_TRUE(parsed.aliased_outputs_elided);
  EXPECT_EQ(std::vector<uint8_t>(parsed.payload, parsed.payload + parsed.payload_size), testing::ExamplePayload());
  // Byte for byte what the C++ writer produces.
  EXPECT_EQ(MustSerialize(expected), bytes);
}

TEST(BlobTest, ReadsEveryOlderVersion) {
  for (uint16_t version = 1; version < kFormatVersion; ++version) {
    const std::string name = "v" + std::to_string(version) + "_valid_caller_kv";
    const std::vector<uint8_t> bytes = ReadFile(FixtureDir() + "/" + name + ".blob");
    const Blob parsed = MustParse(bytes);
    EXPECT_EQ(parsed.format_version, version) << name;
    EXPECT_EQ(parsed.metadata, testing::CallerKvBlob().metadata) << name;
    EXPECT_EQ(std::vector<uint8_t>(parsed.payload, parsed.payload + parsed.payload_size), testing::ExamplePayload());
  }
}

TEST(BlobTest, RefusesANewerVersionNamingBothVersions) {
  Blob blob;
  std::optional<Error> error = Parse(ReadFile(FixtureDir() + "/newer_version.blob").data(),
                                     ReadFile(FixtureDir() + "/newer_version.blob").size(), &blob);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->code, ErrorCode::kUnsupportedVersion);
  const std::string both = "format version " + std::to_string(kFormatVersion + 1) + ", newer than version " +
                           std::to_string(kFormatVersion);
  EXPECT_NE(error->message.find(both), std::string::npos) << error->message;
}

TEST(BlobTest, AnOlderVersionIsWrittenOnlyWithoutTheFieldsItLacks) {
  Blob blob = testing::CallerKvBlob();
  blob.format_version = 1;
  const std::vector<uint8_t> version_1 = MustSerialize(blob);
  EXPECT_EQ(MustParse(version_1).format_version, 1);
  blob.metadata.constants = {Constant{"w", "zerokv/w", DType::kFloat32, {2}, {1}, 0}};
  std::vector<uint8_t> bytes;
  std::optional<Error> error = Serialize(blob, &bytes);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->code, ErrorCode::kUnsupportedVersion);
  EXPECT_NE(error->message.find("metadata.constants"), std::string::npos) << error->message;
}

TEST(BlobTest, WriterRefusesAnInvalidBlob) {
  Blob blob = testing::CallerKvBlob();
  blob.metadata.aliased_io.push_back(blob.metadata.aliased_io[0]);
  std::vector<uint8_t> bytes = {1, 2, 3};
  std::optional<Error> error = Serialize(blob, &bytes);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->code, ErrorCode::kDuplicateAlias);
  EXPECT_EQ(bytes, (std::vector<uint8_t>{1, 2, 3})) << "a refused write must leave the output untouched";
}

TEST(BlobTest, EveryTruncationIsRefusedWithoutReadingPastTheEnd) {
  const std::vector<uint8_t> bytes = MustSerialize(testing::CallerKvBlob());
  for (size_t size = 0; size < bytes.size(); ++size) {
    // A copy of exactly `size` bytes, so that ASan catches any read past it.
    std::vector<uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(size));
    Blob blob;
    EXPECT_TRUE(Parse(prefix.data(), prefix.size(), &blob).has_value()) << "accepted a " << size << "-byte prefix";
  }
}

TEST(BlobTest, DelegateSignatureDropsElidedAndRuntimeOwnedBindings) {
  Blob blob = testing::CallerKvBlob();
  DelegateSignature elided = ComputeDelegateSignature(blob.metadata, true);
  EXPECT_EQ(elided.inputs, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(elided.outputs, (std::vector<size_t>{3}));
  DelegateSignature threaded = ComputeDelegateSignature(blob.metadata, false);
  EXPECT_EQ(threaded.outputs, (std::vector<size_t>{3, 4, 5}));

  blob.metadata.kv_layers = {KVLayer{"k_cache", "v_cache", "layers.0", DType::kFloat32, 2, 16, KVPolicy::kFlat, 0, 8, 64}};
  DelegateSignature runtime_owned = ComputeDelegateSignature(blob.metadata, false);
  EXPECT_EQ(runtime_owned.inputs, (std::vector<size_t>{0}));
  EXPECT_EQ(runtime_owned.outputs, (std::vector<size_t>{3}));
  EXPECT_EQ(runtime_owned.arity(), 2u);
}

TEST(BlobFormatTest, ElementBytesSizesEveryDType) {
  EXPECT_EQ(ElementBytes(DType::kFloat32), sizeof(float));
  EXPECT_EQ(ElementBytes(DType::kBfloat16), 2u);
  EXPECT_EQ(ElementBytes(DType::kInt64), sizeof(int64_t));
  EXPECT_EQ(ElementBytes(DType::kBool), sizeof(bool));
  for (int raw = 0; raw <= UINT8_MAX; ++raw) {
    const auto dtype = static_cast<DType>(raw);
    EXPECT_EQ(ElementBytes(dtype) != 0, IsValid(dtype)) << raw;
  }
}

TEST(BlobFormatTest, FromStringReadsWhatToStringWrites) {
  for (int raw = 1; raw <= UINT8_MAX; ++raw) {
    const auto dtype = static_cast<DType>(raw);
    if (!IsValid(dtype)) continue;
    DType parsed = raw == 1 ? DType::kBool : DType::kFloat32;
    ASSERT_TRUE(FromString(ToString(dtype), &parsed)) << ToString(dtype);
    EXPECT_EQ(parsed, dtype);
  }
  KVPolicy policy = KVPolicy::kFlat;
  ASSERT_TRUE(FromString("RING", &policy));
  EXPECT_EQ(policy, KVPolicy::kRing);
  DType untouched = DType::kInt8;
  EXPECT_FALSE(FromString("FLOAT64", &untouched));
  EXPECT_FALSE(FromString("float32", &untouched));
  EXPECT_EQ(untouched, DType::kInt8);
}

}  // namespace
}  // namespace zerokv::blob
