"""The Triton kernels Inductor writes while it compiles, by the names the compiled code launches them
by: what zerokv.kernels.dependent_launch.waiting_inductor_kernels reads to name the Inductor kernels
that may take a programmatic edge in the engine's CUDA graph.

Inductor names each kernel as it defines it (`TritonScheduling.define_kernel`, which returns the
name); `kernel_sources_recorded(defined)` keeps {name: source} for the compile and calls
`defined(sources)` after each. Where a torch defines its kernels some other way, nothing is
recorded, so no Inductor kernel is named: it launches after the kernel before it ends, as captured.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping


@contextlib.contextmanager
def kernel_sources_recorded(defined: Callable[[Mapping[str, str]], None] = lambda sources: None):
    from torch._inductor.codegen.triton import TritonScheduling

    sources: dict[str, str] = {}
    original = TritonScheduling.define_kernel

    def define_kernel(self, src_code, node_schedule, kernel):
        name = original(self, src_code, node_schedule, kernel)
        sources[name] = src_code
        defined(sources)
        return name

    TritonScheduling.define_kernel = define_kernel
    try:
        yield sources
    finally:
        TritonScheduling.define_kernel = original
