// The AOTInductor engine kind: the blob's payload is an AOTInductor package (.pt2) compiled by
// py/zerokv/aoti (compile_aoti) for the CPU or for CUDA, run with libtorch's
// AOTIModelPackageLoader.
//
// Weights: from blob format version 3 the package holds the compiled code only, and each of its
// constants (by fully qualified name) is a blob constant read from the program's named data. The
// engine hands the package tensors over those bytes (load_constants, user-managed): on the CPU
// views of the mapped entries, never copied; on CUDA one copy onto the device, shared by every
// engine of the process that reads the same entry (keys are content hashes), so a program's
// prefill and decode delegates hold each weight once. Format 1 and 2 packages carry their weights
// in their code and are loaded as they are. The package (kernel code only, no weights) reaches
// libtorch's loader as a file in memory (memfd); the loader itself unpacks it into
// $TMPDIR/aotinductor_XXXXXX and loads its wrapper .so from there while the engine lives.
//
// The package carries its own binding table in its AOTInductor metadata (written by compile_aoti,
// read back here), so that the runtime checks the blob against what the engine reports rather
// than against itself:
//   zerokv.bindings  "name:INPUT|OUTPUT:DTYPE;..."  engine order: inputs, then outputs
//   zerokv.aliases   "output=input;..."             outputs written through an input
//   zerokv.device    "cpu" | "cuda"
//   zerokv.cuda_graph "0" | "1"                     capture runs as CUDA graphs (CUDA packages)
//   zerokv.dependent_launch_kernels "name,..."     kernels that wait for the kernel before them
//
// CUDA graphs (zerokv.cuda_graph, where torch's CUDA libraries are linked: ZEROKV_WITH_TORCH_CUDA):
// the second consecutive run with the same binding (every bound address and capacity, every input
// shape, the stream) is captured with at::cuda::CUDAGraph, its intermediates in the graph's private pool, and
// replayed while the binding stays; a new binding (a runtime-owned cache that grew, another step
// width) runs once as it is and is captured at its next run. A binding that differs from the
// replayed one only in where the caches are and their capacity (a growth) is captured at once, and
// the executable graph updated in place from that capture; Prepare, given that binding ahead (the
// caches' reserves), captures it then, so that the growth step only updates and replays. A capture
// that fails turns graphs off for the engine, with a message on stderr, and the run goes on
// uncaptured. In each capture, the edges into the kernels that zerokv.dependent_launch_kernels
// names (a package compiled on sm_90 or later) are made programmatic (dependent_launch.h): those
// kernels launch before the kernel they follow has ended.
//
// Aliased I/O: a cache the model mutates is an input AOTInductor writes in place (an in-place
// index_copy_ compiles to a kernel that stores into the input's buffer). The engine wraps every
// bound address with at::from_blob, so that buffer is the caller's (or the runtime's): the update
// costs no copy. The aliased output is not returned by the model; it is the input's buffer.
// Other outputs are returned in AOTInductor-owned memory and copied to the bound address on the
// same stream (CUDA packages: where its BUILD file finds a CUDA toolkit, ZEROKV_WITH_CUDA).
//
// Linking //cc/engines/aoti (alwayslink) registers the factory for blob::EngineKind::kAoti.
#pragma once

#include <cstdint>
#include <memory>

#include "cc/blob/blob.h"
#include "cc/engines/engine.h"

namespace zerokv::engines {

// CUDA graph replays by every AOTInductor engine of the process so far: what the checks count to
// tell replayed runs from runs that went on uncaptured (0 where graphs are off or not built).
uint64_t CudaGraphReplays();

// Of those graphs, the ones made by updating an executable graph in place for a binding that moved
// (a runtime-owned cache grew) instead of instantiating a new one.
uint64_t CudaGraphUpdates();

// Graphs for a binding that moved (updated in place or instantiated) whose capture was made ahead,
// by Prepare, rather than in the step that switched to the binding.
uint64_t CudaGraphsCapturedAhead();

// The kernel-to-kernel edges made programmatic in captured graphs (dependent_launch.h), and the
// graphs that have any, by every AOTInductor engine of the process so far.
uint64_t DependentLaunchEdges();
uint64_t DependentLaunchGraphs();

// Loads the AOTInductor package in blob.payload (device blob.device_id for a CUDA package) and its
// constants from `named_data`.
Status CreateAotiEngine(const blob::Blob& blob, const NamedDataMap* named_data,
                        std::unique_ptr<Engine>* engine);

}  // namespace zerokv::engines
