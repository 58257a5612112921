// A C++ runner for the exported tiny decoder (export_tiny_decoder.py), linked against zerokv's
// runtime: decode steps through ExecuTorch's Module API, each step's output checked against the
// running sum the cache holds when every earlier step's write reached it.
//
//   tiny_decoder_test PROGRAM.pte PROGRAM.ptd   (the program and its weights)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor_ptr.h>
#include <executorch/runtime/platform/runtime.h>

namespace {

using executorch::extension::Module;
using executorch::extension::make_tensor_ptr;

constexpr int kWidth = 4;

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s PROGRAM.pte PROGRAM.ptd\n", argv[0]);
    return 2;
  }
  executorch::runtime::runtime_init();
  Module module(argv[1], argv[2], Module::LoadMode::Mmap);

  const std::vector<float> step_values = {1.5f, 0.25f, -3.0f};
  std::vector<float> written_sum(kWidth, 0.0f);
  for (int64_t position = 0; position < static_cast<int64_t>(step_values.size()); ++position) {
    auto x = make_tensor_ptr(std::vector<float>(kWidth, step_values[position]));
    auto position_tensor = make_tensor_ptr(std::vector<int64_t>{position});
    auto outputs = module.forward({x, position_tensor});
    if (!outputs.ok()) {
      std::fprintf(stderr, "step %lld: forward failed with error 0x%x\n",
                   static_cast<long long>(position), static_cast<unsigned>(outputs.error()));
      return 1;
    }
    const auto& summed = outputs.get().at(0).toTensor();
    for (int i = 0; i < kWidth; ++i) {
      written_sum[i] += 2.0f * step_values[position];
      const float got = summed.const_data_ptr<float>()[i];
      if (std::fabs(got - written_sum[i]) > 1e-5f) {
        std::fprintf(stderr, "step %lld, element %d: got %g, want %g (a cache write was lost)\n",
                     static_cast<long long>(position), i, got, written_sum[i]);
        return 1;
      }
    }
    std::printf("step %lld: cache sum %g\n", static_cast<long long>(position), written_sum[0]);
  }
  return 0;
}
