// The CUDA check of runtime-owned KV caches (gpu_runtime_kv_check_test, tagged gpu): an AOTInductor
// attention step whose BF16 K and V caches the runtime owns (make_runtime_kv_blob.py), through
// ExecuTorch's BackendInterface, the storage in CUDA memory.
//
//   gpu_runtime_kv_check DIR caller-stream|own-stream
//
// Two delegates of the one blob share the cache by storage key, as a program's prefill and decode
// methods do (both at home in the implicit sequence); every decode step's caller position is wrong
// on purpose, the runtime supplying the positions: "prefill" writes PREFILL tokens, "decode" then DECODE single tokens, far past the
// initial capacity (4 growths, 4 -> 64). With own-stream each delegate runs on its own
// non-blocking stream, so only the cache's event orders the decode's growth copies after the
// prefill's writes; with caller-stream both run on one non-blocking caller stream. Every execute is
// enqueued before any host synchronization: a missing dependency shows up as a wrong output, a
// use-after-free of the old storage as a compute-sanitizer memcheck report. Then: metrics through
// the C API (growths, bytes moved, amortized bytes per token) and a reset (storage zeroed on the
// stream of the next step) followed by the prefill again.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>

#include "cc/kvcache/c_api.h"
#include "cc/runtime/backend.h"
#include "cc/runtime/caller_stream.h"
#include "cc/runtime/delegate.h"
#include "cc/runtime/testing/et_tensor.h"
#include "cc/runtime/testing/gpu_check.h"

namespace {

using executorch::aten::ScalarType;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::DelegateHandle;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::Span;
using zerokv::runtime::testing::OwnedTensor;
using ET = executorch::runtime::etensor::DeviceType;

// As in make_runtime_kv_blob.py.
constexpr int kHeads = 2, kHeadDim = 16, kPrefill = 3, kDecode = 40, kMaxCapacity = 64;
constexpr int kMaxWidth = 8;  // the blob's bound on a step's tokens (x and the output, dim 2)

std::vector<uint16_t> ReadBf16(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), {});
  std::vector<uint16_t> values(bytes.size() / 2);
  std::memcpy(values.data(), bytes.data(), values.size() * 2);
  return values;
}

float Bf16ToFloat(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// One step's device buffers and the tensors over them.
struct Step {
  int width = 0;
  int position = 0;
  uint16_t* x = nullptr;
  int64_t* position_data = nullptr;
  uint16_t* out = nullptr;
  std::unique_ptr<OwnedTensor<uint16_t>> x_tensor, out_tensor;
  std::unique_ptr<OwnedTensor<int64_t>> position_tensor;

  size_t elements() const { return static_cast<size_t>(kHeads) * width * kHeadDim; }
};

DelegateHandle* Init(executorch::runtime::BackendInterface* backend, std::vector<uint8_t>& bytes,
                     const char* method) {
  BackendInitContext context(nullptr, nullptr, method);
  FreeableBuffer processed(bytes.data(), bytes.size(), nullptr);
  auto handle = backend->init(context, &processed, {});
  CHECK(handle.ok(), "init of %s failed", method);
  return handle.ok() ? handle.get() : nullptr;
}

Error Execute(executorch::runtime::BackendInterface* backend, DelegateHandle* handle, Step& step) {
  BackendExecutionContext context;
  // Delegate arguments: x, position, then the output; the caches are not arguments.
  EValue* args[] = {step.x_tensor->value(), step.position_tensor->value(), step.out_tensor->value()};
  return backend->execute(context, handle, Span<EValue*>(args, 3));
}

// Compares a step's output with eager's: BF16 attention, so a relative tolerance of a few ulps.
void CheckOutput(const Step& step, const uint16_t* expected, const char* what) {
  std::vector<uint16_t> got(step.elements());
  CUDA_OK(cudaMemcpy(got.data(), step.out, got.size() * 2, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float a = Bf16ToFloat(got[i]), b = Bf16ToFloat(expected[i]);
    if (!(std::fabs(a - b) <= 3e-2f + 3e-2f * std::fabs(b))) ++wrong;
  }
  CHECK(wrong == 0, "%s (position %d): %d of %zu outputs differ from eager", what, step.position,
        wrong, got.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DIR caller-stream|own-stream\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const bool caller_stream = std::string(argv[2]) == "caller-stream";
  executorch::runtime::runtime_init();
  auto* backend = executorch::runtime::get_backend_class(zerokv::runtime::kBackendName);
  CHECK(backend != nullptr, "ZeroKVBackend is not registered");
  if (backend == nullptr) return 1;

  std::ifstream file(dir + "/runtime_kv.blob", std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(file)), {});
  DelegateHandle* prefill = Init(backend, bytes, "prefill");
  DelegateHandle* decode = Init(backend, bytes, "decode");
  if (prefill == nullptr || decode == nullptr) return 1;

  const std::vector<uint16_t> xs = ReadBf16(dir + "/x.bin");
  const std::vector<uint16_t> expected = ReadBf16(dir + "/expected.bin");
  std::vector<Step> steps(1 + kDecode);
  size_t offset = 0;
  int position = 0;
  std::vector<size_t> offsets;
  for (size_t i = 0; i < steps.size(); ++i) {
    Step& step = steps[i];
    step.width = i == 0 ? kPrefill : 1;
    step.position = position;
    position += step.width;
    const size_t elements = step.elements();
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&step.x), elements * 2));
    CUDA_OK(cudaMemcpy(step.x, xs.data() + offset, elements * 2, cudaMemcpyHostToDevice));
    // The output is planned at its largest shape, as ExecuTorch plans a bounded dynamic output:
    // the delegate resizes it to the largest shape before binding, then to the engine's.
    const size_t out_elements = static_cast<size_t>(kHeads) * kMaxWidth * kHeadDim;
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&step.out), out_elements * 2));
    CUDA_OK(cudaMemset(step.out, 0xff, out_elements * 2));  // NaN until written
    // The runtime supplies every step's position; the caller's is wrong on purpose.
    const int64_t where = i == 0 ? 0 : 2;
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&step.position_data), sizeof(int64_t)));
    CUDA_OK(cudaMemcpy(step.position_data, &where, sizeof(int64_t), cudaMemcpyHostToDevice));
    const std::vector<int32_t> shape = {1, kHeads, step.width, kHeadDim};
    step.x_tensor = std::make_unique<OwnedTensor<uint16_t>>(ScalarType::BFloat16, shape, ET::CUDA, step.x);
    step.out_tensor = std::make_unique<OwnedTensor<uint16_t>>(
        ScalarType::BFloat16, std::vector<int32_t>{1, kHeads, kMaxWidth, kHeadDim}, ET::CUDA, step.out);
    step.position_tensor = std::make_unique<OwnedTensor<int64_t>>(
        ScalarType::Long, std::vector<int32_t>{1}, ET::CUDA, step.position_data);
    offsets.push_back(offset);
    offset += elements;
  }
  CHECK(offset == xs.size() && offset == expected.size(), "x.bin / expected.bin sizes");
  if (failures) return 1;

  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    std::optional<zerokv::runtime::CallerStreamGuard> guard;  // own-stream: none at all
    if (caller_stream) guard.emplace(stream);
    CHECK(Execute(backend, prefill, steps[0]) == Error::Ok, "prefill");
    for (size_t i = 1; i < steps.size(); ++i) {
      CHECK(Execute(backend, decode, steps[i]) == Error::Ok, "decode step %zu", i);
    }
  }
  CUDA_OK(cudaDeviceSynchronize());
  for (size_t i = 0; i < steps.size(); ++i) {
    CheckOutput(steps[i], expected.data() + offsets[i], i == 0 ? "prefill" : "decode");
  }

  ZeroKVCacheMetrics metrics{};
  // Both delegates were loaded without a sequence: at home in the implicit one.
  ZeroKVSequence* sequence = zerokv_kv_implicit_sequence();
  CHECK(sequence != nullptr && zerokv_kv_sequence_metrics(sequence, &metrics) == 1,
        "expected one cache in the implicit sequence");
  const uint64_t tokens = kPrefill + kDecode;
  const uint64_t position_bytes = 2ull * kHeads * kHeadDim * 2;  // K and V, BF16
  CHECK(metrics.length == tokens, "length %llu", static_cast<unsigned long long>(metrics.length));
  CHECK(metrics.capacity == kMaxCapacity, "capacity %llu",
        static_cast<unsigned long long>(metrics.capacity));
  CHECK(metrics.growths == 4, "growths %llu", static_cast<unsigned long long>(metrics.growths));
  CHECK(metrics.bytes_moved == position_bytes * (4 + 8 + 16 + 32), "bytes moved %llu",
        static_cast<unsigned long long>(metrics.bytes_moved));
  std::printf("%s: %llu tokens, %llu growths, %llu bytes moved, amortized %.1f bytes moved per token "
              "(%llu bytes of K and V per token), %llu bytes reserved, %llu in use\n",
              argv[2], static_cast<unsigned long long>(tokens),
              static_cast<unsigned long long>(metrics.growths),
              static_cast<unsigned long long>(metrics.bytes_moved),
              static_cast<double>(metrics.bytes_moved) / static_cast<double>(tokens),
              static_cast<unsigned long long>(position_bytes),
              static_cast<unsigned long long>(metrics.bytes_reserved),
              static_cast<unsigned long long>(metrics.bytes_in_use));

  // Reset, then the prefill again: the same output as on fresh storage (zeroed on the stream).
  CHECK(zerokv_kv_sequence_reset(sequence) == 0, "reset");
  CUDA_OK(cudaMemset(steps[0].out, 0xff, steps[0].elements() * 2));
  CHECK(steps[0].out_tensor->tensor().size(2) == kPrefill, "output not resized to the step");
  {
    std::optional<zerokv::runtime::CallerStreamGuard> guard;  // own-stream: none at all
    if (caller_stream) guard.emplace(stream);
    CHECK(Execute(backend, prefill, steps[0]) == Error::Ok, "prefill after reset");
  }
  CUDA_OK(cudaDeviceSynchronize());
  CheckOutput(steps[0], expected.data(), "prefill after reset");
  CHECK(zerokv_kv_sequence_metrics(sequence, &metrics) == 1 && metrics.length == kPrefill &&
            metrics.capacity == kMaxCapacity,
        "after reset: length %llu capacity %llu", static_cast<unsigned long long>(metrics.length),
        static_cast<unsigned long long>(metrics.capacity));

  zerokv_kv_sequence_release(sequence);
  backend->destroy(prefill);
  backend->destroy(decode);
  CHECK(zerokv_kv_implicit_sequence() == nullptr, "cache outlived its delegates");
  CUDA_OK(cudaStreamDestroy(stream));
  for (Step& step : steps) {
    for (void* p : {static_cast<void*>(step.x), static_cast<void*>(step.out),
                    static_cast<void*>(step.position_data)}) {
      CUDA_OK(cudaFree(p));
    }
  }
  std::printf("%s %s: %d failures\n", argv[2], failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}
