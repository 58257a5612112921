// One decode step of a Llama-architecture decoder (RMSNorm, rotary attention with grouped KV
// heads, SwiGLU MLP, tied or untied LM head) as a single persistent CUDA kernel.
//
// Why one kernel: a step of a 1B model is ~150 dependent kernels when each layer is its own chain
// of norm, products, attention and combine; every boundary costs the memory system microseconds
// it spends idle (tools/bench/decode_roofline_notes.md). Here one CTA per SM runs the whole step.
// In each CTA a producer warp streams that CTA's slice of every weight matrix, in step order, into a
// ring of shared-memory tiles with bulk copies (weights do not depend on the step's activations, so
// it runs ahead across stages), while the consumer warps wait at a grid barrier for the activations
// of the stage before: a barrier's latency is meant to be spent with the ring filling, not with
// HBM idle. As measured so far the step takes 1.47-1.53x the roofline on an H200 and 1.29-1.36x
// on an H100 (f574b00): its fixed costs, the grid barriers above all, weigh more against the H200's
// faster memory (decode_roofline_notes.md).
//
// Contract:
//  - Weights are BF16, row-major [out, in] as torch.nn.Linear keeps them; `qkv` is q, k and v
//    stacked by rows ([heads + 2 * kv_heads] * head_dim rows). The KV caches are BF16
//    [kv_heads, capacity, head_dim] per layer (a transformers StaticCache layer of batch 1).
//  - Every pointer is set. What the step reads with bulk copies (the matrices, the LM head and the
//    KV caches) is 16-byte aligned, the rest aligned to its element, as any CUDA allocation is;
//    LaunchLlamaDecodeStep refuses, naming it, a pointer that is not.
//  - `token` and `position` are device int64 scalars read at the start of the step, so one CUDA
//    graph serves every step. The step attends over positions [0, position] (the cache's rows
//    below `position` and this step's K and V) and writes this step's K and V at row `position`.
//  - A position outside [0, capacity) or a token outside [0, vocab) does no work: no cache row is
//    written, every logit is NaN, and `*error` is set to kBadPosition or kBadToken. Nothing clears
//    it: it says that a step since the caller last zeroed it was refused. It may be mapped host
//    memory, so that the caller reads it without a copy.
//  - `workspace` holds LlamaDecodeWorkspaceBytes(shape) bytes, zeroed once before the first step
//    and used by no one else. Its grid barrier counts the arrivals of one CTA per SM, 5 a layer,
//    and only grows, so every step over it must run on the same GPU with the same shape.
//  - Launched cooperatively with one CTA per SM, so a GPU that cannot hold them all at once is an
//    error at launch rather than a deadlock. Capturable in a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace zerokv::engines::megakernel {

// The shapes the kernel takes (UnsupportedShape says why one is not): zerokv.megakernel.llama_step
// refuses the same models at export, and its limits test holds these numbers and its own equal.
inline constexpr int kMaxLayers = 32;  // the kernel parameters stay under 4 KiB
inline constexpr int kHeadDim = 64;    // the attention stage's thread mapping
inline constexpr int kGroup = 4;       // query heads per KV head: the same mapping
inline constexpr int kSegment = 512;    // a tile's columns: the products' widths are multiples
inline constexpr int kMaxWidth = 8192;  // the widest product the step is tested with (Llama-3.2-1B's MLP);
                                        // a CTA's shared memory grows with the widths

struct LlamaShape {
  int layers = 0;
  int hidden = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int ffn = 0;
  int vocab = 0;
  int capacity = 0;  // KV cache rows per layer
  float rms_eps = 1e-5f;
};

struct LlamaLayer {
  const __nv_bfloat16* input_norm;  // [hidden]
  const __nv_bfloat16* qkv;         // [(heads + 2 * kv_heads) * head_dim, hidden]
  const __nv_bfloat16* o;           // [hidden, heads * head_dim]
  const __nv_bfloat16* post_norm;   // [hidden]
  const __nv_bfloat16* gate;        // [ffn, hidden]
  const __nv_bfloat16* up;          // [ffn, hidden]
  const __nv_bfloat16* down;        // [hidden, ffn]
  __nv_bfloat16* k_cache;           // [kv_heads, capacity, head_dim]
  __nv_bfloat16* v_cache;           // [kv_heads, capacity, head_dim]
};

struct LlamaDecodeArgs {
  LlamaShape shape;
  LlamaLayer layer[kMaxLayers];
  const __nv_bfloat16* embedding;   // [vocab, hidden]
  const __nv_bfloat16* final_norm;  // [hidden]
  const __nv_bfloat16* lm_head;     // [vocab, hidden]; the embedding when tied
  const float* inv_freq;            // [head_dim / 2], scaled as the rotary embedding's
  float rope_attention_scaling = 1.0f;
  const int64_t* token;
  const int64_t* position;
  __nv_bfloat16* logits;            // [vocab], in the model's dtype as transformers returns them
  void* workspace;
  uint32_t* error;                  // device-accessible; see the contract above
};

// Why `shape` cannot run here, or empty when it can.
std::string UnsupportedShape(const LlamaShape& shape);

size_t LlamaDecodeWorkspaceBytes(const LlamaShape& shape);

// Enqueues one step on `stream`. Fails, naming the cause, on an unsupported shape, a pointer the
// contract refuses, or a GPU that cannot hold one CTA per SM.
cudaError_t LaunchLlamaDecodeStep(const LlamaDecodeArgs& args, cudaStream_t stream, std::string* error);

// The values of LlamaDecodeArgs::error after a refused step.
inline constexpr uint32_t kBadPosition = 1;
inline constexpr uint32_t kBadToken = 2;

}  // namespace zerokv::engines::megakernel
