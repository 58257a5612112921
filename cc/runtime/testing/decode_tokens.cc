// Decodes tokens through a program's method with ExecuTorch's Module API and zerokv's CUDA backend,
// for Python GPU tests: ExecuTorch's Python runtime cannot execute on the GPU machine, whose torch
// is older than the one its bindings were built against (../shared/reference/packages.md).
//
//   decode_tokens PTE PTD METHOD TOKENS LOGITS
//
// TOKENS holds int64 tokens; step i feeds tokens[i] at position i (input 1, which a program over
// runtime-owned caches ignores). LOGITS receives every step's BF16 logits as float32, one step after
// another; nothing is written before TOKENS and the method are read. Exits 1 with a message naming
// what failed.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor_ptr.h>

namespace {

using executorch::aten::ScalarType;
using executorch::extension::make_tensor_ptr;
using executorch::extension::Module;

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "decode_tokens: %s\n", message.c_str());
  std::exit(1);
}

std::vector<int64_t> ReadTokens(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) Fail("cannot read " + path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), {});
  if (bytes.empty() || bytes.size() % sizeof(int64_t) != 0) {
    Fail(path + " holds " + std::to_string(bytes.size()) + " bytes, not a whole number of int64 tokens");
  }
  std::vector<int64_t> tokens(bytes.size() / sizeof(int64_t));
  std::memcpy(tokens.data(), bytes.data(), bytes.size());
  return tokens;
}

// The logits as float32, or a failure naming their dtype.
std::vector<float> AsFloat(const executorch::aten::Tensor& logits) {
  if (logits.scalar_type() != ScalarType::BFloat16) {
    Fail("the first output's dtype is " + std::to_string(static_cast<int>(logits.scalar_type())) +
         ", not bfloat16 (a Llama step's logits)");
  }
  const auto* data = logits.const_data_ptr<executorch::aten::BFloat16>();
  return std::vector<float>(data, data + logits.numel());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) Fail("usage: decode_tokens PTE PTD METHOD TOKENS LOGITS");
  const std::string method = argv[3];
  Module module(argv[1], argv[2], Module::LoadMode::Mmap);
  if (const auto loaded = module.load_method(method); loaded != executorch::runtime::Error::Ok) {
    Fail("cannot load method " + method + " of " + argv[1] + ": error " + std::to_string(static_cast<int>(loaded)));
  }
  const std::vector<int64_t> tokens = ReadTokens(argv[4]);
  std::ofstream out(argv[5], std::ios::binary);
  if (!out) Fail(std::string("cannot write ") + argv[5]);
  for (size_t position = 0; position < tokens.size(); ++position) {
    auto outputs = module.execute(method, {make_tensor_ptr({1, 1}, std::vector<int64_t>{tokens[position]}),
                                           make_tensor_ptr({1}, std::vector<int64_t>{static_cast<int64_t>(position)})});
    if (!outputs.ok()) {
      Fail(method + " at position " + std::to_string(position) + " failed: error " +
           std::to_string(static_cast<int>(outputs.error())));
    }
    const std::vector<float> logits = AsFloat(outputs.get().at(0).toTensor());
    out.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * sizeof(float)));
  }
  out.close();
  if (!out) Fail(std::string("writing ") + argv[5] + " failed");
  return 0;
}
