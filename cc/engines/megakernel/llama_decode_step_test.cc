// The shapes the persistent decode step refuses, each with the reason named (no GPU needed).
#include "cc/engines/megakernel/llama_decode_step.h"

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

}  // namespace
}  // namespace zerokv::engines::megakernel
