// A C entry point to the step of llama_decode_step.h, for callers that hold device pointers and no
// C++ (llama_decode_step.py, through ctypes, with torch's tensors and stream).
#include <cstdint>
#include <cstring>
#include <string>

#include "cc/engines/megakernel/llama_decode_step.h"

namespace {

using zerokv::engines::megakernel::LlamaDecodeArgs;
using zerokv::engines::megakernel::LlamaShape;

constexpr int kPointersPerLayer = 9;

void Report(const std::string& message, char* error, size_t error_size) {
  if (error_size == 0) return;
  std::strncpy(error, message.c_str(), error_size - 1);
  error[error_size - 1] = '\0';
}

// shape: layers, hidden, heads, kv_heads, head_dim, ffn, vocab, capacity.
LlamaShape ShapeOf(const int64_t* shape, double rms_eps) {
  LlamaShape s;
  s.layers = static_cast<int>(shape[0]);
  s.hidden = static_cast<int>(shape[1]);
  s.heads = static_cast<int>(shape[2]);
  s.kv_heads = static_cast<int>(shape[3]);
  s.head_dim = static_cast<int>(shape[4]);
  s.ffn = static_cast<int>(shape[5]);
  s.vocab = static_cast<int>(shape[6]);
  s.capacity = static_cast<int>(shape[7]);
  s.rms_eps = static_cast<float>(rms_eps);
  return s;
}

}  // namespace

extern "C" {

// Bytes of workspace the step of `shape` needs (zeroed once by the caller), or 0 for a shape the
// step does not support (the reason in `error`).
size_t zerokv_megakernel_workspace_bytes(const int64_t* shape, char* error, size_t error_size) {
  const LlamaShape s = ShapeOf(shape, 0.0);
  if (std::string why = zerokv::engines::megakernel::UnsupportedShape(s); !why.empty()) {
    Report("unsupported shape: " + why, error, error_size);
    return 0;
  }
  return zerokv::engines::megakernel::LlamaDecodeWorkspaceBytes(s);
}

// Enqueues one step on `stream`. `pointers`: per layer input_norm, qkv, o, post_norm, gate, up,
// down, k_cache, v_cache; then embedding, final_norm, lm_head, inv_freq, token, position, logits,
// workspace, step_error (a uint32). Returns 0, or the CUDA error with its reason in `error`.
int zerokv_megakernel_launch(const int64_t* shape, double rms_eps, double rope_attention_scaling,
                             const uint64_t* pointers, uint64_t stream, char* error, size_t error_size) {
  LlamaDecodeArgs args{};
  args.shape = ShapeOf(shape, rms_eps);
  if (args.shape.layers < 1 || args.shape.layers > zerokv::engines::megakernel::kMaxLayers) {
    Report("unsupported shape: " + std::to_string(args.shape.layers) + " layers", error, error_size);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  auto bf16 = [&](int i) { return reinterpret_cast<__nv_bfloat16*>(pointers[i]); };
  for (int l = 0; l < args.shape.layers; ++l) {
    const int at = l * kPointersPerLayer;
    args.layer[l] = {bf16(at), bf16(at + 1), bf16(at + 2), bf16(at + 3), bf16(at + 4),
                     bf16(at + 5), bf16(at + 6), bf16(at + 7), bf16(at + 8)};
  }
  const int at = args.shape.layers * kPointersPerLayer;
  args.embedding = bf16(at);
  args.final_norm = bf16(at + 1);
  args.lm_head = bf16(at + 2);
  args.inv_freq = reinterpret_cast<const float*>(pointers[at + 3]);
  args.rope_attention_scaling = static_cast<float>(rope_attention_scaling);
  args.token = reinterpret_cast<const int64_t*>(pointers[at + 4]);
  args.position = reinterpret_cast<const int64_t*>(pointers[at + 5]);
  args.logits = bf16(at + 6);
  args.workspace = reinterpret_cast<void*>(pointers[at + 7]);
  args.error = reinterpret_cast<uint32_t*>(pointers[at + 8]);
  std::string why;
  const cudaError_t status =
      zerokv::engines::megakernel::LaunchLlamaDecodeStep(args, reinterpret_cast<cudaStream_t>(stream), &why);
  if (status != cudaSuccess) Report(why, error, error_size);
  return static_cast<int>(status);
}

}  // extern "C"
