#include "cc/engines/aoti/dependent_launch.h"

#include <cuda.h>

#include <string>
#include <vector>

namespace zerokv::engines {
namespace {

using base::Internal;
using base::NotSupported;
using base::Status;

// The driver's functions, through the runtime (cudaGetDriverEntryPointByVersion): the engine links
// the runtime only, and the driver is what names a kernel launched through a module (AOTInductor
// launches its kernels with cuLaunchKernel).
struct Driver {
  CUresult (*kernel_node_params)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*) = nullptr;
  CUresult (*function_name)(const char**, CUfunction) = nullptr;
  CUresult (*kernel_name)(const char**, CUkernel) = nullptr;
  std::string missing;  // the first function the driver lacks, if any
};

template <typename Function>
void Find(const char* symbol, unsigned int version, Function* function, std::string* missing) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &address, version, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || address == nullptr) {
    cudaGetLastError();
    if (missing->empty()) *missing = std::string(symbol) + " (CUDA " + std::to_string(version) + ")";
    return;
  }
  *function = reinterpret_cast<Function>(address);
}

const Driver& TheDriver() {
  static const Driver driver = [] {
    Driver found;
    Find("cuGraphKernelNodeGetParams", 12000, &found.kernel_node_params, &found.missing);
    Find("cuFuncGetName", 12030, &found.function_name, &found.missing);
    std::string optional;  // only kernels launched as CUkernel handles need it
    Find("cuKernelGetName", 12030, &found.kernel_name, &optional);
    return found;
  }();
  return driver;
}

bool IsKernel(cudaGraphNode_t node) {
  cudaGraphNodeType type{};
  return cudaGraphNodeGetType(node, &type) == cudaSuccess && type == cudaGraphNodeTypeKernel;
}

Status Failed(const char* what, cudaError_t error) {
  return Internal(std::string("dependent launch: ") + what + " failed: " + cudaGetErrorString(error));
}

}  // namespace

std::string KernelNodeName(cudaGraphNode_t node) {
  const Driver& driver = TheDriver();
  if (!driver.missing.empty() || !IsKernel(node)) return "";
  CUDA_KERNEL_NODE_PARAMS params{};
  if (driver.kernel_node_params(node, &params) != CUDA_SUCCESS) return "";
  const char* name = nullptr;
  if (params.func != nullptr) {
    if (driver.function_name(&name, params.func) != CUDA_SUCCESS) return "";
  } else if (params.kern == nullptr || driver.kernel_name == nullptr ||
             driver.kernel_name(&name, params.kern) != CUDA_SUCCESS) {
    return "";
  }
  return name == nullptr ? "" : name;
}

Status LetKernelsLaunchEarly(cudaGraph_t graph, const std::set<std::string>& kernels, int* edges, bool* intact) {
  *intact = true;
  if (kernels.empty()) return Status::Ok();
  if (!TheDriver().missing.empty()) {
    return NotSupported("dependent launch: the CUDA driver lacks " + TheDriver().missing + ", which names kernels");
  }
  size_t count = 0;
  cudaError_t error = cudaGraphGetNodes(graph, nullptr, &count);
  if (error != cudaSuccess) return Failed("cudaGraphGetNodes", error);
  std::vector<cudaGraphNode_t> nodes(count);
  error = cudaGraphGetNodes(graph, nodes.data(), &count);
  if (error != cudaSuccess) return Failed("cudaGraphGetNodes", error);
  for (cudaGraphNode_t node : nodes) {
    const std::string name = KernelNodeName(node);
    if (name.empty() || kernels.count(name) == 0) continue;  // "": not a kernel, or not one it can name
    size_t incoming = 0;
    error = cudaGraphNodeGetDependencies(node, nullptr, nullptr, &incoming);
    if (error != cudaSuccess) return Failed("cudaGraphNodeGetDependencies", error);
    std::vector<cudaGraphNode_t> from(incoming);
    std::vector<cudaGraphEdgeData> data(incoming);
    error = cudaGraphNodeGetDependencies(node, from.data(), data.data(), &incoming);
    if (error != cudaSuccess) return Failed("cudaGraphNodeGetDependencies", error);
    for (size_t i = 0; i < incoming; ++i) {
      if (!IsKernel(from[i]) || data[i].type != cudaGraphDependencyTypeDefault ||
          data[i].from_port != cudaGraphKernelNodePortDefault) {
        continue;
      }
      error = cudaGraphRemoveDependencies(graph, &from[i], &node, &data[i], 1);
      if (error != cudaSuccess) return Failed("cudaGraphRemoveDependencies", error);
      cudaGraphEdgeData programmatic{};
      programmatic.from_port = cudaGraphKernelNodePortProgrammatic;
      programmatic.type = cudaGraphDependencyTypeProgrammatic;
      error = cudaGraphAddDependencies(graph, &from[i], &node, &programmatic, 1);
      if (error != cudaSuccess) {
        cudaGetLastError();
        *intact = cudaGraphAddDependencies(graph, &from[i], &node, &data[i], 1) == cudaSuccess;
        cudaGetLastError();
        return Failed("cudaGraphAddDependencies (a programmatic edge)", error);
      }
      ++*edges;
    }
  }
  return Status::Ok();
}

}  // namespace zerokv::engines
