// The shapes and arguments the persistent decode step refuses, each with the reason named (no GPU needed).
#include "cc/engines/megakernel/llama_decode_step.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace zerokv::engines::megakernel {
namespace {

LlamaShape Llama32OneB() {
  LlamaShape s;
  s.layers = 16;
  s.hidden = 2048;
  s.heads = 32;
  s.kv_heads = 8;
  s.head_dim = 64;
  s.ffn = 8192;
  s.vocab = 128256;
  s.capacity = 32768;
  return s;
}

TEST(UnsupportedShapeTest, AcceptsTheLlama32OneBShape) {
  EXPECT_EQ(UnsupportedShape(Llama32OneB()), "");
  EXPECT_GT(LlamaDecodeWorkspaceBytes(Llama32OneB()), 0u);
}

TEST(UnsupportedShapeTest, NamesTheFieldAtFault) {
  struct Case {
    void (*change)(LlamaShape&);
    std::string why;
  };
  const Case cases[] = {
      {[](LlamaShape& s) { s.layers = 0; }, "layers is 0, not in [1, 32]"},
      {[](LlamaShape& s) { s.layers = 33; }, "layers is 33, not in [1, 32]"},
      {[](LlamaShape& s) { s.head_dim = 128; }, "head_dim is 128, not 64"},
      {[](LlamaShape& s) { s.heads = 24; }, "heads (24) is not 4 x kv_heads (8)"},
      {[](LlamaShape& s) { s.hidden = 2000; }, "hidden is 2000, not a multiple of 512 (a tile's columns)"},
      {[](LlamaShape& s) { s.ffn = 5000; }, "ffn is 5000, not a multiple of 512 (a tile's columns)"},
      {[](LlamaShape& s) { s.ffn = 8704; }, "ffn is 8704, wider than 8192 (the widest product the step is tested with)"},
      {[](LlamaShape& s) { s.heads = 4; s.kv_heads = 1; },
       "heads x head_dim is 256, not a multiple of 512 (a tile's columns)"},
      {[](LlamaShape& s) { s.vocab = 0; }, "vocab is 0"},
      {[](LlamaShape& s) { s.capacity = 0; }, "capacity is 0"},
  };
  for (const Case& c : cases) {
    LlamaShape s = Llama32OneB();
    c.change(s);
    EXPECT_EQ(UnsupportedShape(s), c.why);
  }
}

TEST(LaunchLlamaDecodeStepTest, RefusesAnUnsupportedShapeBeforeTouchingTheGpu) {
  LlamaDecodeArgs args{};
  args.shape = Llama32OneB();
  args.shape.head_dim = 128;
  std::string error;
  EXPECT_EQ(LaunchLlamaDecodeStep(args, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_EQ(error, "unsupported shape: head_dim is 128, not 64");
}

// Every pointer the step reads or writes, set to distinct 256-byte aligned addresses that the host
// never dereferences.
LlamaDecodeArgs AlignedArgs() {
  LlamaDecodeArgs args{};
  args.shape = Llama32OneB();
  uintptr_t next = 0x10000;
  auto take = [&next]() { return next += 256; };
  for (int l = 0; l < args.shape.layers; ++l) {
    LlamaLayer& layer = args.layer[l];
    for (const __nv_bfloat16** weight : {&layer.input_norm, &layer.qkv, &layer.o, &layer.post_norm, &layer.gate,
                                         &layer.up, &layer.down}) {
      *weight = reinterpret_cast<const __nv_bfloat16*>(take());
    }
    layer.k_cache = reinterpret_cast<__nv_bfloat16*>(take());
    layer.v_cache = reinterpret_cast<__nv_bfloat16*>(take());
  }
  args.embedding = reinterpret_cast<const __nv_bfloat16*>(take());
  args.final_norm = reinterpret_cast<const __nv_bfloat16*>(take());
  args.lm_head = reinterpret_cast<const __nv_bfloat16*>(take());
  args.inv_freq = reinterpret_cast<const float*>(take());
  args.token = reinterpret_cast<const int64_t*>(take());
  args.position = reinterpret_cast<const int64_t*>(take());
  args.logits = reinterpret_cast<__nv_bfloat16*>(take());
  args.workspace = reinterpret_cast<void*>(take());
  args.error = reinterpret_cast<uint32_t*>(take());
  return args;
}

template <class T>
T* Offset(T* p, int bytes) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) + bytes);
}

TEST(LaunchLlamaDecodeStepTest, NamesANullPointerBeforeTouchingTheGpu) {
  LlamaDecodeArgs args = AlignedArgs();
  args.layer[3].post_norm = nullptr;
  std::string error;
  EXPECT_EQ(LaunchLlamaDecodeStep(args, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_EQ(error, "unusable argument: layer 3's post_norm is null");
  args = AlignedArgs();
  args.workspace = nullptr;
  EXPECT_EQ(LaunchLlamaDecodeStep(args, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_EQ(error, "unusable argument: workspace is null");
}

TEST(LaunchLlamaDecodeStepTest, NamesAPointerTheStepCannotReadAsItMust) {
  struct Case {
    void (*change)(LlamaDecodeArgs&);
    std::string why;
  };
  const Case cases[] = {
      {[](LlamaDecodeArgs& a) { a.layer[5].k_cache = Offset(a.layer[5].k_cache, 2); },
       "layer 5's k_cache is not 16-byte aligned (the step copies it 16 bytes at a time)"},
      {[](LlamaDecodeArgs& a) { a.layer[0].gate = Offset(a.layer[0].gate, 8); },
       "layer 0's gate is not 16-byte aligned (the step copies it 16 bytes at a time)"},
      {[](LlamaDecodeArgs& a) { a.lm_head = Offset(a.lm_head, 4); },
       "lm_head is not 16-byte aligned (the step copies it 16 bytes at a time)"},
      {[](LlamaDecodeArgs& a) { a.position = Offset(a.position, 4); }, "position is not 8-byte aligned"},
      {[](LlamaDecodeArgs& a) { a.logits = Offset(a.logits, 1); }, "logits is not 2-byte aligned"},
  };
  for (const Case& c : cases) {
    LlamaDecodeArgs args = AlignedArgs();
    c.change(args);
    std::string error;
    EXPECT_EQ(LaunchLlamaDecodeStep(args, nullptr, &error), cudaErrorInvalidValue);
    EXPECT_EQ(error, "unusable argument: " + c.why);
  }
}

TEST(LaunchLlamaDecodeStepTest, LooksOnlyAtTheLayersTheShapeHas) {
  LlamaDecodeArgs args = AlignedArgs();
  args.shape.layers = 2;
  args.layer[2] = LlamaLayer{};
  std::string error;
  LaunchLlamaDecodeStep(args, nullptr, &error);
  EXPECT_EQ(error.find("unusable argument"), std::string::npos) << error;
}

}  // namespace
}  // namespace zerokv::engines::megakernel
