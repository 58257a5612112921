// The example's programs on a CUDA GPU through ExecuTorch's Module API, zerokv's backend and its CUDA
// DeviceAllocator (kv_decode_gpu_test, tagged gpu, runs the check; kv_decode_gpu_bench the bench;
// kv_decode_gpu_export.py writes the programs).
//
//   kv_decode_gpu check DIR own-stream|caller-stream [STEPS]
//     DIR/kv_decode.pte's prefill, then each decode step, against eager's logits (DIR/reference.bin)
//     for the same tokens (DIR/tokens.bin); then DIR/kv_decode_graph.pte's, whose engines capture
//     their runs as CUDA graphs and replay them, loaded over page-locked host buffers
//     (PinnedPlannedMemory: the logits must come back into page-locked memory). The caches are
//     runtime-owned and grow while decoding.
//     With caller-stream every execute runs under a CallerStreamGuard on a cudaStreamNonBlocking
//     stream; the only host synchronization per step is the allocator's wait before it copies the
//     logits out (and, over page-locked buffers, after each input's copy), so a missing dependency
//     (a step reading the KV before the previous step wrote it, an input copy racing the kernels)
//     shows up as logits that differ from eager.
//
//   kv_decode_gpu bench DIR CTX...
//     Per decode step latency (median) and bytes copied host<->device at each context length, side
//     by side in rounds: zero-copy (DIR/CTX/zero_copy.pte), staged (DIR/CTX/staged.pte), the bare
//     engine of the zero-copy delegate (DIR/CTX/engine.blob: Enqueue + stream synchronize over
//     device buffers, nothing around it), and eager PyTorch as measured by the export
//     (DIR/eager.tsv).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor_ptr.h>
#include <executorch/runtime/platform/runtime.h>

#include "cc/engines/aoti/aoti_engine.h"
#include "cc/kvcache/c_api.h"
#include "cc/runtime/caller_stream.h"
#include "cc/runtime/device_allocators/copy_counters.h"
#include "cc/runtime/device_allocators/pinned_planned_memory.h"
#include "cc/runtime/testing/bare_engine.h"
#include "cc/runtime/testing/gpu_check.h"

namespace {

using executorch::extension::make_tensor_ptr;
using executorch::extension::Module;
using executorch::runtime::EValue;
using Clock = std::chrono::steady_clock;

template <typename T>
std::vector<T> ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), {});
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

uint64_t CopiedBytes() { return zerokv_host_to_device_bytes() + zerokv_device_to_host_bytes(); }

// Runs `method` of `module` on [1, tokens] tokens at `position`; returns the logits (host memory),
// and where the method left them in `logits_data` when given.
std::vector<float> Step(Module& module, const std::string& method, std::vector<int64_t> tokens, int64_t position,
                        const void** logits_data = nullptr) {
  const auto count = static_cast<executorch::aten::SizesType>(tokens.size());
  auto token_tensor = make_tensor_ptr({1, count}, std::move(tokens));
  auto position_tensor = make_tensor_ptr(std::vector<executorch::aten::SizesType>{}, std::vector<int64_t>{position});
  auto outputs = module.execute(method, {token_tensor, position_tensor});
  if (!outputs.ok()) {
    std::fprintf(stderr, "%s at position %lld failed: error 0x%x\n", method.c_str(),
                 static_cast<long long>(position), static_cast<unsigned>(outputs.error()));
    std::exit(1);
  }
  const auto& logits = outputs.get().at(0).toTensor();
  if (logits_data != nullptr) *logits_data = logits.const_data_ptr();
  return std::vector<float>(logits.const_data_ptr<float>(), logits.const_data_ptr<float>() + logits.numel());
}

// Compares `got` with `want` row by row (rows of `vocab` logits): top-1 and cosine similarity.
void Compare(const std::vector<float>& got, const float* want, size_t vocab, const char* what, int64_t position,
             double* min_cosine, double* max_error) {
  CHECK(got.size() % vocab == 0, "%s: %zu logits", what, got.size());
  for (size_t row = 0; row * vocab < got.size(); ++row) {
    const float* g = got.data() + row * vocab;
    const float* w = want + row * vocab;
    double dot = 0, gg = 0, ww = 0, scale = 0, error = 0;
    for (size_t i = 0; i < vocab; ++i) {
      dot += double(g[i]) * w[i];
      gg += double(g[i]) * g[i];
      ww += double(w[i]) * w[i];
      scale = std::max(scale, std::fabs(double(w[i])));
      error = std::max(error, std::fabs(double(g[i]) - w[i]));
    }
    const double cosine = dot / std::sqrt(gg * ww);
    *min_cosine = std::min(*min_cosine, cosine);
    *max_error = std::max(*max_error, error / scale);
    const auto top = [vocab](const float* row) { return std::max_element(row, row + vocab) - row; };
    CHECK(cosine > 0.9999 && error <= 1e-3 * scale, "%s at position %lld row %zu: cosine %.7f, max error %g of %g",
          what, static_cast<long long>(position), row, cosine, error, scale);
    CHECK(top(g) == top(w) || std::fabs(g[top(g)] - g[top(w)]) <= 1e-3 * scale,
          "%s at position %lld row %zu: top-1 %td, eager %td", what, static_cast<long long>(position), row, top(g),
          top(w));
  }
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void CheckProgram(const std::string& dir, const std::string& program, bool caller_stream, int64_t prompt,
                  int64_t steps, int64_t vocab, int64_t layers, const std::vector<int64_t>& tokens,
                  const std::vector<float>& reference);

// Both programs of DIR: kv_decode (each step run as it is) and kv_decode_graph (the same, its
// engines' runs captured as CUDA graphs and replayed, captured again at each growth). STEPS (at
// most the exported number) shortens the run for compute-sanitizer.
int Check(const std::string& dir, bool caller_stream, int64_t max_steps) {
  int64_t prompt = 0, exported_steps = 0, vocab = 0, layers = 0;
  std::ifstream(dir + "/shape.txt") >> prompt >> exported_steps >> vocab >> layers;
  const int64_t steps = std::min(exported_steps, max_steps);
  CHECK(prompt > 0 && steps > 0 && vocab > 0 && layers > 0, "%s/shape.txt unreadable", dir.c_str());
  const auto tokens = ReadFile<int64_t>(dir + "/tokens.bin");
  const auto reference = ReadFile<float>(dir + "/reference.bin");
  CHECK(tokens.size() == size_t(prompt + exported_steps) &&
            reference.size() == size_t((prompt + exported_steps) * vocab),
        "tokens.bin / reference.bin do not match shape.txt");
  if (failures) return 1;
  for (const char* program : {"kv_decode", "kv_decode_graph"}) {
    CheckProgram(dir, program, caller_stream, prompt, steps, vocab, layers, tokens, reference);
  }
  return failures == 0 ? 0 : 1;
}

// DIR/PROGRAM.pte, on a sequence of its own.
void CheckProgram(const std::string& dir, const std::string& program, bool caller_stream, int64_t prompt,
                  int64_t steps, int64_t vocab, int64_t layers, const std::vector<int64_t>& tokens,
                  const std::vector<float>& reference) {
  ZeroKVSequence* caches = zerokv_kv_sequence_create();
  zerokv_kv_sequence_select(caches);  // the Module loads at home there
  const bool pinned = program == "kv_decode_graph";
  std::vector<std::unique_ptr<zerokv::runtime::PinnedPlannedMemory>> memory;  // outlives the module
  Module module(dir + "/" + program + ".pte", dir + "/" + program + ".ptd", Module::LoadMode::Mmap);
  for (const char* method : {"decode", "prefill"}) {
    if (pinned) {
      memory.emplace_back();
      const zerokv::base::Status loaded = zerokv::runtime::PinnedPlannedMemory::LoadMethod(module, method, &memory.back());
      CHECK(loaded.ok(), "%s: %s", program.c_str(), loaded.message().c_str());
    } else {
      CHECK(module.load_method(method) == executorch::runtime::Error::Ok, "%s: cannot load %s", program.c_str(), method);
    }
  }
  zerokv_kv_sequence_select(nullptr);
  const uint64_t replays_before = zerokv::engines::CudaGraphReplays();
  const uint64_t updates_before = zerokv::engines::CudaGraphUpdates();
  const uint64_t ahead_before = zerokv::engines::CudaGraphsCapturedAhead();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  double min_cosine = 1, max_error = 0;
  ZeroKVCacheMetrics metrics{};
  std::vector<double> growing_steps, plain_steps;  // decode step times (ms), with and without a growth
  {
    std::optional<zerokv::runtime::CallerStreamGuard> guard;  // own-stream: none at all
    if (caller_stream) guard.emplace(stream);
    const void* logits_data = nullptr;
    auto logits = Step(module, "prefill", std::vector<int64_t>(tokens.begin(), tokens.begin() + prompt), 0, &logits_data);
    cudaPointerAttributes attributes{};
    CUDA_OK(cudaPointerGetAttributes(&attributes, logits_data));
    CHECK((attributes.type == cudaMemoryTypeHost) == pinned, "%s: the logits came back into %s memory", program.c_str(),
          attributes.type == cudaMemoryTypeHost ? "page-locked" : "pageable");
    Compare(logits, reference.data(), vocab, "prefill", 0, &min_cosine, &max_error);
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t position = prompt + step;
      const uint64_t growths_before = metrics.growths;
      const auto started = Clock::now();
      logits = Step(module, "decode", {tokens[position]}, position);
      const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
      Compare(logits, reference.data() + position * vocab, vocab, "decode", position, &min_cosine, &max_error);
      CHECK(zerokv_kv_sequence_metrics(caches, &metrics) == layers, "expected %lld runtime-owned caches",
            static_cast<long long>(layers));
      CHECK(metrics.length == uint64_t((position + 1) * layers), "decode at %lld: %llu positions committed",
            static_cast<long long>(position), static_cast<unsigned long long>(metrics.length / layers));
      (metrics.growths > growths_before ? growing_steps : plain_steps).push_back(elapsed);
    }
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  zerokv_kv_sequence_release(caches);
  CHECK(metrics.growths > 0, "the caches never grew: the check would not cover growth");
  // Graphs or not, the logits above are eager's; this says which the steps were. With graphs, only
  // the first decode step runs uncaptured (the prefill's one run is another engine's), or the first
  // two when the first grew the caches: a step that grows them updates the executable graph in
  // place, from a capture made ahead once every cache held its reserve (all but the first growth,
  // which comes before any graph).
  const uint64_t replays = zerokv::engines::CudaGraphReplays() - replays_before;
  const uint64_t updates = zerokv::engines::CudaGraphUpdates() - updates_before;
  const uint64_t ahead = zerokv::engines::CudaGraphsCapturedAhead() - ahead_before;
  const bool graphs = program == "kv_decode_graph";
  CHECK(graphs ? replays + 2 >= static_cast<uint64_t>(steps) && updates + 1 >= growing_steps.size() &&
                     ahead + 1 >= growing_steps.size() && updates > 0
               : replays == 0 && updates == 0 && ahead == 0,
        "%s: %llu CUDA graph replays of %lld decode steps, %llu graph updates (%llu captured ahead) for %zu "
        "steps that grew the caches",
        program.c_str(), static_cast<unsigned long long>(replays), static_cast<long long>(steps),
        static_cast<unsigned long long>(updates), static_cast<unsigned long long>(ahead), growing_steps.size());
  std::printf("%s %s %s: prefill %lld + %lld decode steps, min cosine %.7f, max error %.2e (of the largest logit), "
              "capacity %llu, %llu growths (all layers) moved %llu bytes, %llu graph replays, %llu graph updates (%llu captured ahead), %d failures\n",
              program.c_str(), caller_stream ? "caller-stream" : "own-stream", failures == 0 ? "PASS" : "FAIL",
              static_cast<long long>(prompt), static_cast<long long>(steps), min_cosine, max_error,
              static_cast<unsigned long long>(metrics.capacity / layers),
              static_cast<unsigned long long>(metrics.growths), static_cast<unsigned long long>(metrics.bytes_moved),
              static_cast<unsigned long long>(replays), static_cast<unsigned long long>(updates),
              static_cast<unsigned long long>(ahead), failures);
  if (!growing_steps.empty() && !plain_steps.empty()) {
    std::printf("decode step: median %.3f ms without a growth (%zu steps), %.3f ms with one (%zu steps)\n",
                Median(plain_steps), plain_steps.size(), Median(growing_steps), growing_steps.size());
  }
}

int Bench(const std::string& dir, const std::vector<int64_t>& contexts) {
  constexpr int kWarmup = 5, kRounds = 5, kStepsPerRound = 20;
  std::map<int64_t, double> eager;
  {
    std::ifstream file(dir + "/eager.tsv");
    int64_t context;
    double milliseconds;
    while (file >> context >> milliseconds) eager[context] = milliseconds;
  }
  std::printf("| context | zero-copy ms | staged ms | eager ms | bare engine ms | zero-copy bytes/step | "
              "staged bytes/step | staged / zero-copy | eager / zero-copy | zero-copy / bare |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (int64_t context : contexts) {
    const std::string base = dir + "/" + std::to_string(context);
    Module zero_copy(base + "/zero_copy.pte", base + "/zero_copy.ptd", Module::LoadMode::Mmap);
    Module staged(base + "/staged.pte", base + "/staged.ptd", Module::LoadMode::Mmap);
    zerokv::testing::BareEngine bare(base + "/engine.blob", base + "/zero_copy.ptd");
    bare.SetPosition(context / 2);
    std::vector<double> times[3];
    uint64_t bytes[2] = {0, 0};
    int64_t position = context / 2;
    for (int round = 0; round < kWarmup + kRounds; ++round) {
      Module* modules[2] = {&zero_copy, &staged};
      for (int variant = 0; variant < 3; ++variant) {
        for (int step = 0; step < (round < kWarmup ? 1 : kStepsPerRound); ++step) {
          const uint64_t copied = CopiedBytes();
          const auto started = Clock::now();
          if (variant < 2) {
            Step(*modules[variant], "forward", {(position * 7) % 4096}, position);
          } else {
            bare.Step();
          }
          const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
          if (round >= kWarmup) {
            times[variant].push_back(elapsed);
            if (variant < 2) bytes[variant] = std::max(bytes[variant], CopiedBytes() - copied);
          }
          position = context / 2 + (position + 1 - context / 2) % (context / 2);
        }
      }
    }
    const double zc = Median(times[0]), st = Median(times[1]), floor = Median(times[2]);
    const double eager_ms = eager.count(context) ? eager[context] : NAN;
    std::printf("| %lld | %.3f | %.3f | %.3f | %.3f | %llu | %llu | %.1fx | %.2fx | %.2fx |\n",
                static_cast<long long>(context), zc, st, eager_ms, floor, static_cast<unsigned long long>(bytes[0]),
                static_cast<unsigned long long>(bytes[1]), st / zc, eager_ms / zc, zc / floor);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  executorch::runtime::runtime_init();
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "check" && (argc == 4 || argc == 5)) {
    return Check(argv[2], std::string(argv[3]) == "caller-stream", argc == 5 ? std::stoll(argv[4]) : INT64_MAX);
  }
  if (mode == "bench" && argc >= 4) {
    std::vector<int64_t> contexts;
    for (int i = 3; i < argc; ++i) contexts.push_back(std::stoll(argv[i]));
    return Bench(argv[2], contexts);
  }
  std::fprintf(stderr, "usage: %s check DIR own-stream|caller-stream [STEPS]\n       %s bench DIR CTX...\n", argv[0], argv[0]);
  return 2;
}
