// The MEGAKERNEL engine kind (blob::EngineKind::kMegakernel): the decode step of a Llama-architecture
// decoder as one persistent CUDA kernel (llama_decode_step.h). Linking this library registers it.
//
// What the blob holds (py/zerokv/executorch/megakernel_engine.py writes it, from the op of
// py/zerokv/megakernel/llama_step.py):
//  - payload: the step's settings, one "name value" line each: rms_eps, rope_attention_scaling;
//  - constants, each a whole named data entry (contiguous, offset 0): per layer l, BF16
//      layers.<l>.input_norm [hidden]       layers.<l>.qkv  [(heads + 2 kv_heads) head_dim, hidden]
//      layers.<l>.o [hidden, heads head_dim] layers.<l>.post_norm [hidden]
//      layers.<l>.gate, layers.<l>.up [ffn, hidden]  layers.<l>.down [hidden, ffn]
//    then embedding and lm_head [vocab, hidden], final_norm [hidden] (BF16) and inv_freq
//    [head_dim / 2] (FLOAT32, as the rotary embedding scales it). Tied weights share a key, and
//    each key is copied to the device once;
//  - bindings, each named as the blob names it, in this order: inputs token and position (INT64,
//    one element each), then the K and V caches of each layer (BF16 [1, kv_heads, capacity,
//    head_dim]); outputs the caches' writes in the same order (each written through its input)
//    and the logits (BF16 [1, 1, vocab]). The caches may be runtime-owned (cc/kvcache): their
//    capacity is read from their shape at each step.
//
// A step reads token and position on the device, attends over cache rows [0, position) and this
// step's K and V, and writes them at row position. A step whose position is outside the caches or
// whose token is outside the vocabulary writes no cache row and leaves every logit NaN; the
// engine's next Enqueue fails naming what was refused. One step runs at a time per engine: its
// workspace is the engine's.
#pragma once

#include <memory>

#include "cc/engines/engine.h"

namespace zerokv::engines::megakernel {

Status CreateMegakernelEngine(const blob::Blob& blob, const NamedDataMap* named_data,
                              std::unique_ptr<Engine>* engine);

}  // namespace zerokv::engines::megakernel
