// The CUDA end-to-end check of the zerokv runtime (gpu_decode_check_test, tagged gpu): a CUDA
// AOTInductor decode step (py/zerokv/aoti/make_decode_blob.py --device cuda) through ExecuTorch's
// BackendInterface, the cache in cudaMalloc'd memory tagged DeviceType::CUDA.
//
//   gpu_decode_check BLOB caller-stream|own-stream
//
// Two decode steps; the second must see the first's write. Checked with pointers (the address the
// engine was bound to is the caller's cudaMalloc'd cache) and bytes (the whole cache copied back
// after the run: exactly the written positions changed). With caller-stream the steps run on a
// cudaStreamNonBlocking stream under a CallerStreamGuard and nothing synchronizes between them:
// the execute returns with the work in flight, and the check reads results only after
// synchronizing that stream, so a missing dependency shows up as wrong bytes or a sanitizer report.
// With own-stream no guard is set: a consumer that is not ours (a plain copy on another
// non-blocking stream) reads each output as soon as execute returns, which is right only because
// the delegate finishes its own stream before returning.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>

#include "cc/runtime/backend.h"
#include "cc/runtime/caller_stream.h"
#include "cc/runtime/delegate.h"
#include "cc/runtime/testing/et_tensor.h"
#include "cc/runtime/testing/gpu_check.h"

namespace {

using executorch::aten::ScalarType;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::Span;
using zerokv::runtime::testing::OwnedTensor;
using ET = executorch::runtime::etensor::DeviceType;

constexpr int kPositions = 8;
constexpr int kCacheFloats = 2 * kPositions * 4;

template <typename T>
T* DeviceCopyOf(const std::vector<T>& host) {
  T* device = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(T)));
  CUDA_OK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

template <typename T>
std::vector<T> HostCopyOf(const T* device, size_t count) {
  std::vector<T> host(count);
  CUDA_OK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s BLOB caller-stream|own-stream\n", argv[0]);
    return 2;
  }
  const bool caller_stream = std::string(argv[2]) == "caller-stream";
  executorch::runtime::runtime_init();
  auto* backend = executorch::runtime::get_backend_class(zerokv::runtime::kBackendName);
  CHECK(backend != nullptr, "ZeroKVBackend is not registered");
  if (backend == nullptr) return 1;

  std::ifstream file(argv[1], std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(file)), {});
  BackendInitContext init_context(nullptr, nullptr, "forward");
  FreeableBuffer processed(bytes.data(), bytes.size(), nullptr);
  auto handle = backend->init(init_context, &processed, {});
  CHECK(handle.ok(), "init failed");
  if (!handle.ok()) return 1;
  auto* delegate = static_cast<zerokv::runtime::Delegate*>(handle.get());

  float* cache_data = DeviceCopyOf(std::vector<float>(kCacheFloats, 0.0f));
  OwnedTensor<float> cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CUDA, cache_data);
  float* x1 = DeviceCopyOf(std::vector<float>(8, 1.5f));
  float* x2 = DeviceCopyOf(std::vector<float>(8, 0.25f));
  int64_t* pos1 = DeviceCopyOf(std::vector<int64_t>{2});
  int64_t* pos2 = DeviceCopyOf(std::vector<int64_t>{5});
  float* attention1 = DeviceCopyOf(std::vector<float>(8, -1.0f));
  float* attention2 = DeviceCopyOf(std::vector<float>(8, -1.0f));
  OwnedTensor<float> x_1(ScalarType::Float, {1, 2, 1, 4}, ET::CUDA, x1);
  OwnedTensor<float> x_2(ScalarType::Float, {1, 2, 1, 4}, ET::CUDA, x2);
  OwnedTensor<int64_t> pos_1(ScalarType::Long, {1}, ET::CUDA, pos1);
  OwnedTensor<int64_t> pos_2(ScalarType::Long, {1}, ET::CUDA, pos2);
  OwnedTensor<float> att_1(ScalarType::Float, {1, 2, 4}, ET::CUDA, attention1);
  OwnedTensor<float> att_2(ScalarType::Float, {1, 2, 4}, ET::CUDA, attention2);

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // own-stream: a consumer that is not ours reads each output the moment execute returns (a plain
  // copy on another non-blocking stream, as another backend or the reader of a device-resident
  // method output would): only the delegate finishing its own stream before returning orders it.
  cudaStream_t consumer = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking));
  std::vector<float> consumed1(8, -2.0f), consumed2(8, -2.0f);
  auto consume = [&](const float* output, std::vector<float>& host) {
    CUDA_OK(cudaMemcpyAsync(host.data(), output, host.size() * sizeof(float), cudaMemcpyDeviceToHost, consumer));
    CUDA_OK(cudaStreamSynchronize(consumer));
  };
  {
    std::optional<zerokv::runtime::CallerStreamGuard> guard;  // own-stream: none at all
    if (caller_stream) guard.emplace(stream);
    BackendExecutionContext context;
    EValue* step1[] = {x_1.value(), pos_1.value(), cache.value(), att_1.value()};
    EValue* step2[] = {x_2.value(), pos_2.value(), cache.value(), att_2.value()};
    CHECK(backend->execute(context, *handle, Span<EValue*>(step1, 4)) == Error::Ok, "step 1");
    if (!caller_stream) consume(attention1, consumed1);
    CHECK(delegate->bound_address("k_cache_out") == cache_data, "step 1 not bound to the cache");
    CHECK(backend->execute(context, *handle, Span<EValue*>(step2, 4)) == Error::Ok, "step 2");
    if (!caller_stream) consume(attention2, consumed2);
    CHECK(delegate->bound_address("k_cache_out") == cache_data, "step 2 not bound to the cache");
  }
  if (caller_stream) {
    CUDA_OK(cudaStreamSynchronize(stream));
  } else {
    backend->destroy(*handle);
    for (int i = 0; i < 8; ++i) {
      CHECK(consumed1[i] == 3.0f, "a consumer not ordered by us read step 1 attention[%d] = %f, want 3", i,
            consumed1[i]);
      CHECK(consumed2[i] == 3.5f, "a consumer not ordered by us read step 2 attention[%d] = %f, want 3.5", i,
            consumed2[i]);
    }
  }
  CUDA_OK(cudaStreamDestroy(consumer));

  std::vector<float> first = HostCopyOf(attention1, 8);
  std::vector<float> second = HostCopyOf(attention2, 8);
  for (int i = 0; i < 8; ++i) {
    CHECK(first[i] == 3.0f, "step 1 attention[%d] = %f, want 3", i, first[i]);
    CHECK(second[i] == 3.5f, "step 2 attention[%d] = %f, want 3.5 (saw step 1's KV?)", i, second[i]);
  }
  std::vector<float> cache_bytes = HostCopyOf(cache_data, kCacheFloats);
  for (int row = 0; row < 2; ++row) {
    for (int position = 0; position < kPositions; ++position) {
      const float want = position == 2 ? 1.5f : position == 5 ? 0.25f : 0.0f;
      for (int h = 0; h < 4; ++h) {
        const float got = cache_bytes[(row * kPositions + position) * 4 + h];
        CHECK(got == want, "cache[%d,%d,%d] = %f, want %f", row, position, h, got, want);
      }
    }
  }

  // A host-resident alias target is refused, and the cache keeps its bytes.
  if (caller_stream) {
    OwnedTensor<float> host_cache(ScalarType::Float, {1, 2, kPositions, 4}, ET::CPU);
    EValue* bad[] = {x_1.value(), pos_1.value(), host_cache.value(), att_1.value()};
    BackendExecutionContext context;
    CHECK(backend->execute(context, *handle, Span<EValue*>(bad, 4)) == Error::InvalidArgument,
          "host-resident alias target accepted");
    backend->destroy(*handle);
    CHECK(HostCopyOf(cache_data, kCacheFloats) == cache_bytes, "cache changed by a refusal");
  }
  CUDA_OK(cudaStreamDestroy(stream));
  for (void* p : {static_cast<void*>(cache_data), static_cast<void*>(x1), static_cast<void*>(x2),
                  static_cast<void*>(pos1), static_cast<void*>(pos2),
                  static_cast<void*>(attention1), static_cast<void*>(attention2)}) {
    CUDA_OK(cudaFree(p));
  }
  std::printf("%s %s: %d failures\n", argv[2], failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}
