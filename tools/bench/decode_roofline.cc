// zerokv's rows of //tools/bench:decode_roofline, on a CUDA GPU, over the programs
// decode_roofline_programs.py wrote to DIR:
//
//   decode_roofline DIR STEPS POSITION...
//
// Every step is timed on the host around ExecuTorch's Module::execute (the token from the host,
// the logits back to it, as the peers' steps are), or around Enqueue plus a synchronize for the
// bare engine. The programs' host buffers are page-locked (PinnedPlannedMemory), as are the bare
// engine's for its host copies. Rows on stdout, tab-separated: variant, position, median ms, p99 ms, steps.
//   zerokv_runtime_owned   DIR/runtime_owned: decodes from position 0 through the last POSITION
//                          plus STEPS, every step timed; a row per POSITION over the STEPS steps
//                          from it; `..._all` over every step, `..._growth` over the steps whose
//                          caches grew, `..._after_growth` over the steps that followed them and
//                          `..._without_growth` over every step that did not grow them (those after
//                          a growth and the first included; p99 column: the slowest);
//                          `..._growth_step` at each step that grew them and `..._slow_step` at each
//                          other step slower than twice the median over every step (position,
//                          then its ms in both columns, 1 step), so that outliers can be placed
//                          between the growths; after each of those, `..._host` at the same
//                          position: what the operating system did to the runner's thread during the
//                          step (involuntary context switches, page faults, and 1 in the steps
//                          column if it ran on another CPU at the end than at the start): a step
//                          with none was not delayed by preemption or faults (interrupts are not
//                          counted);
//   zerokv_megakernel      DIR/megakernel: the same rows as zerokv_runtime_owned's, of the step as
//                          one persistent kernel (the MEGAKERNEL engine), over runtime-owned caches;
//   zerokv_static          DIR/static/zero_copy.pte: STEPS steps from each POSITION;
//   zerokv_staged          DIR/static/staged.pte: 4 steps from each POSITION;
//   bare_engine            DIR/static/engine.blob: STEPS steps at each POSITION;
//   bare_engine_host_io    the same engine, with the token and position copied from the host before
//                          each step and the logits back to it after (BareEngine::StepWithHostIO):
//                          what of a zerokv step's time over the bare engine's is the copies.
// DECODE_ROOFLINE_VARIANTS (comma-separated; every one by default: runtime_owned, megakernel,
// static, staged, bare) picks the variants timed, e.g. "static,bare" to compare two trees' static steps
// (tools/gpu/step_ab.sh), whose DIR then needs only static/ and reference/.
// Each variant's `cuda_graph_replays_<variant>` row gives the CUDA graph replays during its steps,
// warm-up included (median and p99 columns), and the steps (a step that did not replay ran
// uncaptured). The last row, `dependent_launch_edges`, gives the kernel-to-kernel edges the engines
// made programmatic in their captures (median and p99 columns) and the captures that have any.
// Before timing, the runtime-owned, megakernel and static programs decode the reference's tokens from
// position 0 and are compared with Hugging Face eager's logits (DIR/reference); a row
// `agreement_<variant>` gives the smallest cosine (median column) and the steps whose top-1 token
// matches (p99 column) out of the steps compared.
#include <cuda_runtime_api.h>
#include <sched.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor_ptr.h>
#include <executorch/runtime/platform/runtime.h>

#include "cc/engines/aoti/aoti_engine.h"
#include "cc/kvcache/c_api.h"
#include "cc/runtime/device_allocators/pinned_planned_memory.h"
#include "cc/runtime/testing/bare_engine.h"

namespace {

using executorch::extension::make_tensor_ptr;
using executorch::extension::Module;
using zerokv::runtime::PinnedPlannedMemory;
using Clock = std::chrono::steady_clock;

constexpr int kWarmup = 5;
constexpr int kStagedSteps = 4;

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "decode_roofline: %s\n", message.c_str());
  std::exit(1);
}

// A whole positive number from the command line, or a message naming the argument.
int64_t Count(const std::string& what, const std::string& text) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || value <= 0) Fail(what + " '" + text + "' is not a positive whole number");
  return value;
}

template <typename T>
std::vector<T> ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) Fail("cannot read " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), {});
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

// Loads `method` over page-locked host buffers, which `memory` keeps.
void LoadPinned(Module& module, const std::string& method, std::unique_ptr<PinnedPlannedMemory>* memory) {
  const zerokv::base::Status loaded = PinnedPlannedMemory::LoadMethod(module, method, memory);
  if (!loaded.ok()) Fail(loaded.message());
}

// One decode step of `module`'s `method` at `position`: its logits, as float, when `logits` is set.
double Step(Module& module, const std::string& method, int64_t token, int64_t position,
            std::vector<float>* logits = nullptr) {
  const auto started = Clock::now();
  auto outputs = module.execute(method, {make_tensor_ptr({1, 1}, std::vector<int64_t>{token}),
                                         make_tensor_ptr({1}, std::vector<int64_t>{position})});
  const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
  if (!outputs.ok()) {
    Fail(method + " at position " + std::to_string(position) + " failed: error " +
         std::to_string(static_cast<int>(outputs.error())));
  }
  if (logits != nullptr) {
    const auto& tensor = outputs.get().at(0).toTensor();
    if (tensor.scalar_type() != executorch::aten::ScalarType::BFloat16) Fail("the logits are not bfloat16");
    const auto* values = tensor.const_data_ptr<executorch::aten::BFloat16>();
    logits->assign(values, values + tensor.numel());
  }
  return elapsed;
}

void Row(const std::string& variant, int64_t position, std::vector<double> values) {
  if (values.empty()) return;
  std::sort(values.begin(), values.end());
  const size_t p99 = std::min(values.size() - 1, static_cast<size_t>(0.99 * values.size()));
  std::printf("%s\t%lld\t%.4f\t%.4f\t%zu\n", variant.c_str(), static_cast<long long>(position),
              values[values.size() / 2], values[p99], values.size());
  std::fflush(stdout);
}

// What the host's operating system did to this thread, counted since it started.
struct HostCounts {
  long involuntary_switches = 0;
  long page_faults = 0;
  int cpu = -1;

  static HostCounts Now() {
    rusage usage{};
    if (getrusage(RUSAGE_THREAD, &usage) != 0) Fail("getrusage(RUSAGE_THREAD) failed");
    return {usage.ru_nivcsw, usage.ru_minflt + usage.ru_majflt, sched_getcpu()};
  }
};

// A row of `values`' median and slowest (in the p99 column).
void Spread(const std::string& variant, std::vector<double> values) {
  if (values.empty()) return;
  std::sort(values.begin(), values.end());
  std::printf("%s\t0\t%.4f\t%.4f\t%zu\n", variant.c_str(), values[values.size() / 2], values.back(), values.size());
  std::fflush(stdout);
}

// The CUDA graph replays since `before` over `steps` steps of `variant`.
void Replays(const std::string& variant, uint64_t before, size_t steps) {
  const uint64_t replays = zerokv::engines::CudaGraphReplays() - before;
  std::printf("cuda_graph_replays_%s\t0\t%llu\t%llu\t%zu\n", variant.c_str(), static_cast<unsigned long long>(replays),
              static_cast<unsigned long long>(replays), steps);
  std::fflush(stdout);
}

// Eager's reference: the token fed at each position and its logits there.
struct Reference {
  std::vector<int64_t> tokens;
  std::vector<float> logits;
  size_t vocab = 0;
};

// Decodes the reference's tokens from position 0 and prints the agreement row.
void Agree(Module& module, const std::string& method, const Reference& reference, const std::string& variant) {
  double min_cosine = 1;
  size_t matches = 0;
  std::vector<float> logits;
  for (size_t position = 0; position < reference.tokens.size(); ++position) {
    Step(module, method, reference.tokens[position], static_cast<int64_t>(position), &logits);
    if (logits.size() != reference.vocab) Fail(variant + ": the logits have the wrong size");
    const float* want = reference.logits.data() + position * reference.vocab;
    double dot = 0, gg = 0, ww = 0;
    for (size_t i = 0; i < reference.vocab; ++i) {
      dot += double(logits[i]) * want[i];
      gg += double(logits[i]) * logits[i];
      ww += double(want[i]) * want[i];
    }
    min_cosine = std::min(min_cosine, dot / std::sqrt(gg * ww));
    matches += std::max_element(logits.begin(), logits.end()) - logits.begin() ==
               std::max_element(want, want + reference.vocab) - want;
  }
  std::printf("agreement_%s\t0\t%.6f\t%zu\t%zu\n", variant.c_str(), min_cosine, matches, reference.tokens.size());
  std::fflush(stdout);
}

// The program DIR/<program>/decode.pte over runtime-owned caches, its rows named `variant`.
void RuntimeOwned(const std::string& dir, const std::string& program, const std::string& variant,
                  const Reference& reference, int64_t steps, const std::vector<int64_t>& positions) {
  std::unique_ptr<PinnedPlannedMemory> memory;
  Module module(dir + "/" + program + "/decode.pte", dir + "/" + program + "/decode.ptd", Module::LoadMode::Mmap);
  LoadPinned(module, "decode", &memory);
  Agree(module, "decode", reference, program);
  // The agreement left the caches at the reference's length: start over from position 0.
  ZeroKVSequence* caches = zerokv_kv_implicit_sequence();
  if (caches == nullptr || zerokv_kv_sequence_reset(caches) != 0) Fail("cannot reset the runtime-owned caches");
  const int64_t end = *std::max_element(positions.begin(), positions.end()) + steps;
  std::vector<double> times, growth, after_growth, without_growth;
  std::vector<bool> grew;
  std::vector<std::pair<HostCounts, HostCounts>> host;  // at each step's start and end
  // The growth count is cumulative over the sequence's life (the agreement's steps included).
  ZeroKVCacheMetrics metrics{};
  zerokv_kv_sequence_metrics(caches, &metrics);
  const uint64_t replays = zerokv::engines::CudaGraphReplays();
  for (int64_t position = 0; position < end; ++position) {
    const uint64_t growths = metrics.growths;
    const HostCounts started = HostCounts::Now();
    times.push_back(Step(module, "decode", (position * 7) % static_cast<int64_t>(reference.vocab), position));
    host.emplace_back(started, HostCounts::Now());
    if (!grew.empty() && grew.back()) after_growth.push_back(times.back());
    zerokv_kv_sequence_metrics(caches, &metrics);
    grew.push_back(metrics.growths > growths);
    (grew.back() ? growth : without_growth).push_back(times.back());
  }
  Replays(variant, replays, times.size());
  zerokv_kv_sequence_release(caches);
  for (int64_t position : positions) {
    Row(variant, position, {times.begin() + position, times.begin() + position + steps});
  }
  Row(variant + "_all", 0, times);
  Spread(variant + "_growth", growth);
  Spread(variant + "_after_growth", after_growth);
  Spread(variant + "_without_growth", without_growth);
  std::vector<double> sorted = times;
  std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
  const double twice_median = 2 * sorted[sorted.size() / 2];
  for (int64_t position = 0; position < end; ++position) {
    if (grew[position] || times[position] > twice_median) {
      const std::string outlier = variant + (grew[position] ? "_growth_step" : "_slow_step");
      Row(outlier, position, {times[position]});
      const auto& [started, ended] = host[position];
      std::printf("%s_host\t%lld\t%ld\t%ld\t%d\n", outlier.c_str(),
                  static_cast<long long>(position), ended.involuntary_switches - started.involuntary_switches,
                  ended.page_faults - started.page_faults, started.cpu != ended.cpu ? 1 : 0);
      std::fflush(stdout);
    }
  }
}

void Static(const std::string& dir, const std::string& program, const std::string& variant, const Reference* reference,
            int64_t steps, const std::vector<int64_t>& positions) {
  std::unique_ptr<PinnedPlannedMemory> memory;
  Module module(dir + "/static/" + program + ".pte", dir + "/static/" + program + ".ptd", Module::LoadMode::Mmap);
  LoadPinned(module, "forward", &memory);
  if (reference != nullptr) Agree(module, "forward", *reference, variant);
  const uint64_t replays = zerokv::engines::CudaGraphReplays();
  for (int64_t position : positions) {
    std::vector<double> times;
    for (int64_t step = -kWarmup; step < steps; ++step) {
      const int64_t at = position + step;
      const double elapsed = Step(module, "forward", (at * 7) % 1000, at);
      if (step >= 0) times.push_back(elapsed);
    }
    Row(variant, position, times);
  }
  Replays(variant, replays, positions.size() * (kWarmup + steps));
}

void Bare(const std::string& dir, int64_t steps, const std::vector<int64_t>& positions) {
  zerokv::testing::BareEngine engine(dir + "/static/engine.blob", dir + "/static/zero_copy.ptd");
  for (const bool host_io : {false, true}) {
    const std::string variant = host_io ? "bare_engine_host_io" : "bare_engine";
    const uint64_t replays = zerokv::engines::CudaGraphReplays();
    for (int64_t position : positions) {
      engine.SetPosition(position);
      std::vector<double> times;
      for (int64_t step = -kWarmup; step < steps; ++step) {
        const auto started = Clock::now();
        if (host_io) {
          engine.StepWithHostIO((position * 7) % 1000, position);
        } else {
          engine.Step();
        }
        if (step >= 0) times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - started).count());
      }
      Row(variant, position, times);
    }
    Replays(variant, replays, positions.size() * (kWarmup + steps));
  }
}

// The variants DECODE_ROOFLINE_VARIANTS names, or every one.
std::set<std::string> Variants() {
  const std::set<std::string> every = {"runtime_owned", "megakernel", "static", "staged", "bare"};
  const char* named = std::getenv("DECODE_ROOFLINE_VARIANTS");
  if (named == nullptr || *named == '\0') return every;
  std::set<std::string> variants;
  std::stringstream list(named);
  for (std::string variant; std::getline(list, variant, ',');) {
    if (!every.count(variant)) {
      std::string known;
      for (const std::string& name : every) known += (known.empty() ? "" : ", ") + name;
      Fail("DECODE_ROOFLINE_VARIANTS names '" + variant + "'; the variants are " + known);
    }
    variants.insert(variant);
  }
  return variants;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s DIR STEPS POSITION...\n", argv[0]);
    return 2;
  }
  executorch::runtime::runtime_init();
  const std::string dir = argv[1];
  const int64_t steps = Count("STEPS", argv[2]);
  std::vector<int64_t> positions;
  for (int i = 3; i < argc; ++i) {
    positions.push_back(Count("POSITION", argv[i]));
    if (positions.back() < kWarmup) Fail("POSITION " + std::string(argv[i]) + " leaves no room for the warm-up steps");
  }
  const std::set<std::string> variants = Variants();
  Reference reference;
  if (variants.count("runtime_owned") || variants.count("megakernel") || variants.count("static")) {
    reference.tokens = ReadFile<int64_t>(dir + "/reference/tokens.bin");
    reference.logits = ReadFile<float>(dir + "/reference/logits.bin");
    if (reference.tokens.empty() || reference.logits.size() % reference.tokens.size() != 0) {
      Fail(dir + "/reference: tokens.bin and logits.bin do not match");
    }
    reference.vocab = reference.logits.size() / reference.tokens.size();
  }
  if (variants.count("runtime_owned")) {
    RuntimeOwned(dir, "runtime_owned", "zerokv_runtime_owned", reference, steps, positions);
  }
  if (variants.count("megakernel")) RuntimeOwned(dir, "megakernel", "zerokv_megakernel", reference, steps, positions);
  if (variants.count("static")) Static(dir, "zero_copy", "zerokv_static", &reference, steps, positions);
  if (variants.count("staged")) {
    Static(dir, "staged", "zerokv_staged", nullptr, std::min<int64_t>(steps, kStagedSteps), positions);
  }
  if (variants.count("bare")) Bare(dir, steps, positions);
  const auto edges = static_cast<unsigned long long>(zerokv::engines::DependentLaunchEdges());
  std::printf("dependent_launch_edges\t0\t%llu\t%llu\t%llu\n", edges, edges,
              static_cast<unsigned long long>(zerokv::engines::DependentLaunchGraphs()));
  return 0;
}
