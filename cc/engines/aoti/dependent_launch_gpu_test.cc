// LetKernelsLaunchEarly on a CUDA GPU of sm_90 or later: a writer kernel and a reader kernel that
// waits for it (griddepcontrol.wait), from PTX, captured from one stream as a graph.
#include "cc/engines/aoti/dependent_launch.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace zerokv::engines {
namespace {

// The writer sleeps before it stores, so that a reader which did not wait for it would read the
// buffer's old value; the reader waits, then copies.
constexpr char kPtx[] = R"(
.version 8.0
.target sm_90
.address_size 64

.visible .entry zerokv_test_writer(.param .u64 out, .param .u32 value) {
  .reg .u64 %p;
  .reg .u32 %v;
  .reg .u32 %i;
  .reg .pred %more;
  ld.param.u64 %p, [out];
  cvta.to.global.u64 %p, %p;
  ld.param.u32 %v, [value];
  griddepcontrol.launch_dependents;
  mov.u32 %i, 0;
spin:
  nanosleep.u32 1000;
  add.u32 %i, %i, 1;
  setp.lt.u32 %more, %i, 200;
  @%more bra spin;
  st.global.u32 [%p], %v;
  ret;
}

.visible .entry zerokv_test_reader(.param .u64 in, .param .u64 out) {
  .reg .u64 %a;
  .reg .u64 %b;
  .reg .u32 %v;
  ld.param.u64 %a, [in];
  ld.param.u64 %b, [out];
  cvta.to.global.u64 %a, %a;
  cvta.to.global.u64 %b, %b;
  griddepcontrol.wait;
  ld.global.u32 %v, [%a];
  st.global.u32 [%b], %v;
  ret;
}
)";

template <typename Function>
Function Driver(const char* symbol) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(symbol, &address, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Function>(address);
}

class DependentLaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int major = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess)
        << "this test needs a CUDA GPU";
    if (major < 9) GTEST_SKIP() << "programmatic edges need sm_90 or later, this GPU is sm_" << major << "x";
    ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // the primary context, current
    auto load = Driver<CUresult (*)(CUmodule*, const void*)>("cuModuleLoadData");
    auto function = Driver<CUresult (*)(CUfunction*, CUmodule, const char*)>("cuModuleGetFunction");
    launch_ = Driver<decltype(launch_)>("cuLaunchKernel");
    ASSERT_TRUE(load && function && launch_);
    ASSERT_EQ(load(&module_, kPtx), CUDA_SUCCESS);
    ASSERT_EQ(function(&writer_, module_, "zerokv_test_writer"), CUDA_SUCCESS);
    ASSERT_EQ(function(&reader_, module_, "zerokv_test_reader"), CUDA_SUCCESS);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&buffer_), 2 * sizeof(uint32_t)), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }

  void TearDown() override {
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (buffer_ != nullptr) cudaFree(buffer_);
  }

  // Captures: the buffer's two words zeroed, the writer storing `value` into the first, the reader
  // copying it into the second.
  void Capture(uint32_t value) {
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(buffer_, 0, 2 * sizeof(uint32_t), stream_), cudaSuccess);
    void* written = buffer_;
    void* copied = buffer_ + 1;
    void* writer_args[] = {&written, &value};
    void* reader_args[] = {&written, &copied};
    ASSERT_EQ(launch_(writer_, 1, 1, 1, 32, 1, 1, 0, stream_, writer_args, nullptr), CUDA_SUCCESS);
    ASSERT_EQ(launch_(reader_, 1, 1, 1, 32, 1, 1, 0, stream_, reader_args, nullptr), CUDA_SUCCESS);
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph_), cudaSuccess);
  }

  // The edges into the node that launches `name`.
  std::vector<cudaGraphEdgeData> EdgesInto(const std::string& name) {
    size_t count = 0;
    cudaGraphGetNodes(graph_, nullptr, &count);
    std::vector<cudaGraphNode_t> nodes(count);
    cudaGraphGetNodes(graph_, nodes.data(), &count);
    for (cudaGraphNode_t node : nodes) {
      if (KernelNodeName(node) != name) continue;
      size_t incoming = 0;
      cudaGraphNodeGetDependencies(node, nullptr, nullptr, &incoming);
      std::vector<cudaGraphNode_t> from(incoming);
      std::vector<cudaGraphEdgeData> data(incoming);
      cudaGraphNodeGetDependencies(node, from.data(), data.data(), &incoming);
      return data;
    }
    ADD_FAILURE() << "no kernel node named " << name;
    return {};
  }

  uint32_t Run() {
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph_, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    uint32_t copied = 0;
    EXPECT_EQ(cudaMemcpy(&copied, buffer_ + 1, sizeof(copied), cudaMemcpyDeviceToHost), cudaSuccess);
    cudaGraphExecDestroy(exec);
    return copied;
  }

  CUresult (*launch_)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                      void**, void**) = nullptr;
  CUmodule module_ = nullptr;
  CUfunction writer_ = nullptr;
  CUfunction reader_ = nullptr;
  uint32_t* buffer_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
};

TEST_F(DependentLaunchTest, NamesTheKernelsItLaunches) {
  Capture(7);
  ASSERT_EQ(EdgesInto("zerokv_test_writer").size(), 1u);  // from the memset, which is not a kernel
  ASSERT_EQ(EdgesInto("zerokv_test_reader").size(), 1u);
}

TEST_F(DependentLaunchTest, TheEdgeIntoANamedKernelBecomesProgrammaticAndItStillReadsWhatWasWritten) {
  Capture(7);
  int edges = 0;
  bool intact = false;
  const base::Status made = LetKernelsLaunchEarly(graph_, {"zerokv_test_reader"}, &edges, &intact);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_TRUE(intact);
  EXPECT_EQ(edges, 1);
  const std::vector<cudaGraphEdgeData> into_reader = EdgesInto("zerokv_test_reader");
  ASSERT_EQ(into_reader.size(), 1u);
  EXPECT_EQ(into_reader[0].type, cudaGraphDependencyTypeProgrammatic);
  EXPECT_EQ(into_reader[0].from_port, cudaGraphKernelNodePortProgrammatic);
  for (int run = 0; run < 20; ++run) EXPECT_EQ(Run(), 7u) << "run " << run;
}

TEST_F(DependentLaunchTest, OnlyEdgesBetweenKernelsIntoNamedOnesChange) {
  Capture(5);
  int edges = 0;
  bool intact = false;
  // The writer follows a memset: that edge is not between kernels. The reader is not named.
  ASSERT_TRUE(LetKernelsLaunchEarly(graph_, {"zerokv_test_writer"}, &edges, &intact).ok());
  EXPECT_EQ(edges, 0);
  EXPECT_EQ(EdgesInto("zerokv_test_writer")[0].type, cudaGraphDependencyTypeDefault);
  EXPECT_EQ(EdgesInto("zerokv_test_reader")[0].type, cudaGraphDependencyTypeDefault);
  ASSERT_TRUE(LetKernelsLaunchEarly(graph_, {}, &edges, &intact).ok());
  EXPECT_EQ(edges, 0);
  // An empty name stands for no node, not for the nodes it cannot name (the memset).
  ASSERT_TRUE(LetKernelsLaunchEarly(graph_, {""}, &edges, &intact).ok());
  EXPECT_EQ(edges, 0);
  EXPECT_EQ(Run(), 5u);
}

}  // namespace
}  // namespace zerokv::engines
