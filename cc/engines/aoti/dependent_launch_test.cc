// Which kernels a package's names cover (NamesKernel); no GPU needed.
#include "cc/engines/aoti/dependent_launch.h"

#include <gtest/gtest.h>

namespace zerokv::engines {
namespace {

TEST(NamesKernelTest, ANameNamesThatKernelOnly) {
  const std::set<std::string> kernels = {"_matvec_kernel"};
  EXPECT_TRUE(NamesKernel(kernels, "_matvec_kernel"));
  EXPECT_FALSE(NamesKernel(kernels, "_matvec_kernel_2"));
  EXPECT_FALSE(NamesKernel(kernels, "_matvec"));
}

TEST(NamesKernelTest, AStarredEntryNamesTheKernelsThatBeginWithIt) {
  const std::set<std::string> kernels = {"triton_poi_*", "triton_red_*"};
  EXPECT_TRUE(NamesKernel(kernels, "triton_poi_fused_add_0"));
  EXPECT_TRUE(NamesKernel(kernels, "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_9"));
  EXPECT_TRUE(NamesKernel(kernels, "triton_poi_"));
  EXPECT_FALSE(NamesKernel(kernels, "triton_tem_fused_mm_0"));  // a template: Inductor gives it no wait
  EXPECT_FALSE(NamesKernel(kernels, "triton_po"));
  EXPECT_FALSE(NamesKernel(kernels, "triton_poi*"));
}

TEST(NamesKernelTest, NoEntryNamesAKernelWithoutAName) {
  EXPECT_FALSE(NamesKernel({"*"}, ""));
  EXPECT_FALSE(NamesKernel({""}, ""));
  EXPECT_TRUE(NamesKernel({"*"}, "any"));
  EXPECT_FALSE(NamesKernel({}, "any"));
}

}  // namespace
}  // namespace zerokv::engines
