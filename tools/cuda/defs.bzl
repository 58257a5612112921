"""cuda_library: a cc_library of CUDA sources, compiled by the toolkit's nvcc (@zerokv_cuda).

rules_cc has no CUDA support, and the offline registries have no rules_cuda: nvcc runs as one
action per source, its position-independent object is the library's. Where no CUDA toolkit is
found the library is incompatible, so `bazel test //...` skips what needs it.
"""

load("@rules_cc//cc:defs.bzl", "cc_library")
load("@zerokv_cuda//:defs.bzl", CUDA_COMPATIBLE_WITH = "COMPATIBLE_WITH")

# The kernels use Hopper's bulk copies and transaction barriers: sm_90a code, no PTX to JIT elsewhere.
CUDA_ARCH = "sm_90a"

def cuda_library(name, srcs, hdrs, deps = [], visibility = None, **kwargs):
    """A cc_library whose `srcs` (.cu files) nvcc compiles for CUDA_ARCH.

    Args:
      name: the cc_library.
      srcs: .cu files; each may include `hdrs` by their path from the repository root.
      hdrs: headers of the library, public as a cc_library's.
      deps: cc_library deps of the library (not seen by nvcc: `hdrs` and the CUDA headers are).
      visibility: the cc_library's.
      **kwargs: to the cc_library (tags, target_compatible_with is set here).
    """

    # The repository root as the action sees it: "." here, external/<repo> in a workspace using zerokv.
    root = native.package_relative_label(":" + name).workspace_root or "."
    objects = []
    for src in srcs:
        if not src.endswith(".cu"):
            fail("cuda_library %s: %s is not a .cu file" % (name, src))
        stem = src[:-len(".cu")]
        objects.append("_%s/%s.pic.o" % (name, stem))
        native.genrule(
            name = "_%s_%s_nvcc" % (name, stem.replace("/", "_")),
            srcs = [src] + hdrs,
            outs = [objects[-1]],
            tools = ["@zerokv_cuda//:nvcc"],
            # nvcc finds its toolkit (headers, cicc, ptxas) next to the path it runs from: its real
            # one, not the sandbox's link to it.
            cmd = " ".join([
                "$$(readlink -f $(execpath @zerokv_cuda//:nvcc))",
                "-std=c++17 -O3 -arch=%s -Xcompiler -fPIC" % CUDA_ARCH,
                "-I%s" % root,
                "-c $(location %s) -o $@" % src,
            ]),
            target_compatible_with = CUDA_COMPATIBLE_WITH,
            visibility = ["//visibility:private"],
        )
    cc_library(
        name = name,
        srcs = objects,
        hdrs = hdrs,
        deps = deps + ["@zerokv_cuda//:cudart"],
        target_compatible_with = CUDA_COMPATIBLE_WITH,
        visibility = visibility,
        **kwargs
    )
