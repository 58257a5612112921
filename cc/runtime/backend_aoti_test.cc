// The backend end to end on the CPU, through ExecuTorch's BackendInterface, with a real
// AOTInductor decode step (py/zerokv/aoti:decode_blobs) whose weight is named data in a real .ptd,
// mapped: two steps, the second sees the KV the first wrote, and the engine wrote through the
// caller's buffer (pointer and bytes); the package reaches libtorch's loader without a file of
// the engine's under $TMPDIR. Then every refusal: a truncated or corrupt blob, missing or
// wrong named data, a wrong argument count, a host-resident alias target, each a clear error with
// the caller's buffers untouched.
#include <sys/inotify.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <executorch/extension/data_loader/mmap_data_loader.h>
#include <executorch/extension/flat_tensor/flat_tensor_data_map.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>
#include <gtest/gtest.h>

#include "cc/blob/blob.h"
#include "cc/engines/engine.h"
#include "cc/engines/testing/in_memory_named_data.h"
#include "cc/runtime/backend.h"
#include "cc/runtime/delegate.h"
#include "cc/runtime/testing/et_tensor.h"
#include "cc/runtime/testing/binding_recorder.h"

namespace zerokv::runtime {
namespace {

using executorch::aten::ScalarType;
using executorch::extension::FlatTensorDataMap;
using executorch::extension::MmapDataLoader;
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

// The .ptd at $env, mapped as ExecuTorch's Module maps a program's data file.
struct NamedData {
  explicit NamedData(const char* env) {
    const char* path = std::getenv(env);
    EXPECT_NE(path, nullptr) << env;
    auto mapped = MmapDataLoader::from(path);
    EXPECT_TRUE(mapped.ok()) << path;
    loader.emplace(std::move(mapped.get()));
    auto loaded = FlatTensorDataMap::load(&*loader);
    EXPECT_TRUE(loaded.ok()) << path;
    map.emplace(std::move(loaded.get()));
  }
  std::optional<MmapDataLoader> loader;
  std::optional<FlatTensorDataMap> map;
};

class BackendAotiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executorch::runtime::runtime_init();
    backend_ = executorch::runtime::get_backend_class(kBackendName);
    ASSERT_NE(backend_, nullptr) << "ZeroKVBackend is not registered";
  }
  executorch::runtime::Result<DelegateHandle*> Init(std::vector<uint8_t>& bytes,
                                                    const executorch::runtime::NamedDataMap* named_data) {
    BackendInitContext context(nullptr, nullptr, "forward", named_data);
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
  auto handle = Init(bytes, nullptr);
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

// Sets an environment variable for a scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The names of what was created in (or moved into) the watched directory, each with whether it
// is a directory, as inotify reported them since the last call.
std::vector<std::pair<std::string, bool>> Created(int watch) {
  std::vector<std::pair<std::string, bool>> created;
  alignas(inotify_event) char buffer[4096];
  ssize_t n;
  while ((n = read(watch, buffer, sizeof(buffer))) > 0) {
    for (char* at = buffer; at < buffer + n;) {
      const auto* event = reinterpret_cast<const inotify_event*>(at);
      created.emplace_back(event->len ? event->name : "", (event->mask & IN_ISDIR) != 0);
      at += sizeof(inotify_event) + event->len;
    }
  }
  return created;
}

// The engine writes no file under $TMPDIR: the package reaches libtorch's loader as a file in
// memory. What appears there is the loader's own extraction directory (torch 2.13 unpacks the
// package into $TMPDIR/aotinductor_XXXXXX and loads its wrapper .so from there), which goes with
// the engine.
TEST_F(BackendAotiTest, ThePackageIsNotWrittenToATemporaryFile) {
  const char* test_tmpdir = std::getenv("TEST_TMPDIR");
  ASSERT_NE(test_tmpdir, nullptr);
  std::string tmpdir = std::string(test_tmpdir) + "/tmpdir_XXXXXX";
  ASSERT_NE(mkdtemp(tmpdir.data()), nullptr) << tmpdir;
  const int watch = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  ASSERT_GE(watch, 0);
  ASSERT_GE(inotify_add_watch(watch, tmpdir.c_str(), IN_CREATE | IN_MOVED_TO), 0);
  ScopedEnv env("TMPDIR", tmpdir);

  std::vector<uint8_t> bytes = ReadBlob("DECODE_WEIGHTED_BLOB");
  NamedData named_data("DECODE_WEIGHTED_PTD");
  auto handle = Init(bytes, &*named_data.map);
  ASSERT_TRUE(handle.ok());
  for (const auto& [name, is_directory] : Created(watch)) {
    EXPECT_TRUE(is_directory) << "a file was written under $TMPDIR: " << name;
  }
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  Step step(1.0f, 3);
  ASSERT_EQ(Execute(*handle, {step.x.value(), step.pos.value(), cache.value(), step.attention.value()}),
            Error::Ok);
  EXPECT_EQ(step.attention.data()[0], 2.0f);  // 1.0 * make_decode_blob.py's weight[0][0]
  backend_->destroy(*handle);
  EXPECT_EQ(rmdir(tmpdir.c_str()), 0) << tmpdir << " is not empty after the engine is gone";
  close(watch);
}

TEST_F(BackendAotiTest, NotElidedBlobTakesTheAliasedOutputArgument) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_NOT_ELIDED_BLOB");
  auto handle = Init(bytes, nullptr);
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
  auto refused = Init(truncated, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error(), Error::InvalidProgram);

  std::vector<uint8_t> bad_magic = bytes;
  bad_magic[0] ^= 0xff;
  EXPECT_EQ(Init(bad_magic, nullptr).error(), Error::InvalidProgram);

  // A payload that is not an AOTInductor package: the header and metadata are intact.
  std::vector<uint8_t> bad_payload = bytes;
  for (size_t i = bytes.size() - 64; i < bytes.size(); ++i) bad_payload[i] = 0;
  for (size_t i = bytes.size() / 2; i < bytes.size() / 2 + 64; ++i) bad_payload[i] ^= 0x5a;
  EXPECT_EQ(Init(bad_payload, nullptr).error(), Error::InvalidProgram);
}

using TestNamedData = engines::testing::InMemoryNamedData;

blob::Blob MustParse(const std::vector<uint8_t>& bytes) {
  blob::Blob parsed;
  std::optional<blob::Error> error = blob::Parse(bytes.data(), bytes.size(), &parsed);
  EXPECT_FALSE(error.has_value()) << error->message;
  return parsed;
}

std::string CreateError(const blob::Blob& parsed, const executorch::runtime::NamedDataMap* named_data) {
  std::unique_ptr<engines::Engine> engine;
  Status status = engines::CreateEngine(parsed, named_data, &engine);
  EXPECT_FALSE(status.ok()) << "the engine was created";
  return status.message();
}

TEST_F(BackendAotiTest, TheWeightComesFromTheMappedDataFile) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_WEIGHTED_BLOB");
  NamedData named_data("DECODE_WEIGHTED_PTD");
  auto handle = Init(bytes, &*named_data.map);
  ASSERT_TRUE(handle.ok());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  Step step(1.5f, 4);
  ASSERT_EQ(Execute(*handle, {step.x.value(), step.pos.value(), cache.value(), step.attention.value()}),
            Error::Ok);
  const float scale[4] = {2.0f, 3.0f, 4.0f, 5.0f};  // make_decode_blob.py's weight, diag(SCALE)
  for (int i = 0; i < 8; ++i) EXPECT_EQ(step.attention.data()[i], 1.5f * scale[i % 4]) << i;
  backend_->destroy(*handle);
}

TEST_F(BackendAotiTest, TheWeightIsReadInPlaceNotCopied) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_WEIGHTED_BLOB");
  NamedData real("DECODE_WEIGHTED_PTD");
  TestNamedData named_data(*real.map);
  const blob::Blob parsed = MustParse(bytes);
  ASSERT_EQ(parsed.metadata.constants.size(), 1u);
  std::vector<uint8_t>& weight = named_data.entries.at(parsed.metadata.constants[0].key);
  ASSERT_EQ(weight.size(), 4 * 4 * sizeof(float));

  auto handle = Init(bytes, &named_data);
  ASSERT_TRUE(handle.ok());
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA);
  Step first(1.0f, 0);
  ASSERT_EQ(Execute(*handle, {first.x.value(), first.pos.value(), cache.value(), first.attention.value()}),
            Error::Ok);
  EXPECT_EQ(first.attention.data()[0], 2.0f);
  // The engine reads the named data's bytes where they are: changing them changes the next step.
  const float seven = 7.0f;
  std::memcpy(weight.data(), &seven, sizeof(seven));  // weight[0][0]
  Step second(0.0f, 1);
  ASSERT_EQ(Execute(*handle, {second.x.value(), second.pos.value(), cache.value(), second.attention.value()}),
            Error::Ok);
  EXPECT_EQ(second.attention.data()[0], 7.0f);
  backend_->destroy(*handle);
}

TEST_F(BackendAotiTest, MissingOrWrongNamedDataIsRefusedNamingTheConstant) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_WEIGHTED_BLOB");
  NamedData real("DECODE_WEIGHTED_PTD");
  const blob::Blob parsed = MustParse(bytes);
  const std::string key = parsed.metadata.constants[0].key;

  EXPECT_EQ(Init(bytes, nullptr).error(), Error::InvalidProgram);
  EXPECT_NE(CreateError(parsed, nullptr).find("constant 'weight' is named data entry '" + key +
                                              "', but the program has no named data"),
            std::string::npos);

  TestNamedData other(*real.map);
  other.entries.clear();
  other.entries["zerokv/another"] = std::vector<uint8_t>(16);
  EXPECT_NE(CreateError(parsed, &other).find("which the program's named data does not hold"), std::string::npos);

  TestNamedData short_entry(*real.map);
  short_entry.entries.at(key).resize(8);
  EXPECT_NE(CreateError(parsed, &short_entry).find("constant 'weight': its named data entry '" + key + "' holds 8 bytes"),
            std::string::npos);

  blob::Blob wrong_dtype = parsed;
  wrong_dtype.metadata.constants[0].dtype = blob::DType::kBfloat16;
  EXPECT_NE(CreateError(wrong_dtype, &*real.map).find("constant 'weight' is BFLOAT16 in the blob but Float in the AOTInductor package"),
            std::string::npos);

  blob::Blob unlisted = parsed;
  unlisted.metadata.constants.clear();
  EXPECT_NE(CreateError(unlisted, &*real.map).find("needs constant 'weight', which the blob's constants do not list"),
            std::string::npos);

  blob::Blob extra = parsed;
  extra.metadata.constants.push_back(extra.metadata.constants[0]);
  extra.metadata.constants[1].name = "bias";
  EXPECT_NE(CreateError(extra, &*real.map).find("lists constant 'bias', which the AOTInductor package does not have"),
            std::string::npos);
}

TEST_F(BackendAotiTest, WrongArgumentCountAndHostAliasTargetLeaveTheCacheUntouched) {
  std::vector<uint8_t> bytes = ReadBlob("DECODE_ELIDED_BLOB");
  auto handle = Init(bytes, nullptr);
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
