// Programmatic dependent launch in a captured CUDA graph (sm_90 and later).
//
// A decode step is a chain of short kernels; in a graph as captured, each one launches only once
// the kernel before it has ended and its writes are flushed. A programmatic edge lets the kernel
// launch once every block of the kernel before it has signalled (griddepcontrol.launch_dependents)
// or ended, and its griddepcontrol.wait returns once that kernel has completed with its writes
// visible. That is safe only for a kernel that reads nothing the kernel before it may write, and
// writes nothing it may read, before its wait: the kernels named by the package
// (zerokv.kernels.dependent_launch, the metadata zerokv.dependent_launch_kernels). No other kernel
// is touched. A kernel that launched early can only start after its predecessor's blocks have all
// signalled or ended, and that predecessor, waiting in turn or launched after its own predecessor
// ended, completes only after what it follows: the order of the step's writes stays the captured one.
#pragma once

#include <set>
#include <string>

#include <cuda_runtime_api.h>

#include "cc/base/status.h"

namespace zerokv::engines {

// Makes every edge of `graph` from a kernel node into a kernel node whose function is named in
// `kernels` programmatic (cudaGraphKernelNodePortProgrammatic, cudaGraphDependencyTypeProgrammatic),
// and adds the count to *edges. On failure it puts back the edge it was changing; *intact is false
// only if that failed too, and then the graph must not run (it lacks an edge).
base::Status LetKernelsLaunchEarly(cudaGraph_t graph, const std::set<std::string>& kernels, int* edges,
                                   bool* intact);

// The name of the function a kernel node launches (as its module names it: a Triton kernel's is its
// Python function's), or "" for another kind of node or a kernel the driver cannot name.
std::string KernelNodeName(cudaGraphNode_t node);

}  // namespace zerokv::engines
