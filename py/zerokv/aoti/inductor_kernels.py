"""Inductor's kernels and its view of zerokv's, while it compiles.

The Triton kernels Inductor writes, by the names the compiled code launches them by: what
zerokv.kernels.dependent_launch.waiting_inductor_kernels reads to name the Inductor kernels that may
take a programmatic edge in the engine's CUDA graph. Inductor names each kernel as it defines it
(`TritonScheduling.define_kernel`, which returns the name); `kernel_sources_recorded(defined)` keeps
{name: source} for the compile and calls `defined(sources)` after each. Where a torch defines its
kernels some other way, nothing is recorded, so no Inductor kernel is named: it launches after the
kernel before it ends, as captured.

The user kernels Inductor could not analyze: to know which arguments a user Triton kernel (zerokv's)
writes, Inductor compiles it to Triton's IR and reads the stores. Where that fails it logs a warning
and takes every tensor argument for written, and AOTInductor then copies each, the weights
included, before every launch: on the H200 the 1B decode step took 2.5 times as long with an impure
wait, and 1.3 times with a kernel torch 2.11 could not compile for its analysis (5e27c56's
prefetch, reverted). The step is still correct, so nothing else says so:
`kernel_analysis_failures()` collects those warnings for compile_aoti to refuse the package.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Mapping

# Where and how torch reports it (torch/_higher_order_ops/triton_kernel_wrap.py).
_ANALYSIS_LOGGER = "torch._dynamo"
_ANALYSIS_FAILED = "assuming every input is mutated"


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


@contextlib.contextmanager
def kernel_analysis_failures() -> Iterator[list[str]]:
    """Collects, while it is entered, what made Inductor's analysis of a user kernel fail: for each
    failure, where Triton stopped, in which function, and why."""
    failures: list[str] = []

    class Collector(logging.Handler):
        def emit(self, record):
            if _ANALYSIS_FAILED in record.getMessage():
                cause = record.exc_info[1] if record.exc_info else None
                failures.append(_summary(str(cause)) if cause else record.getMessage())

    logger = logging.getLogger(_ANALYSIS_LOGGER)
    collector = Collector(logging.WARNING)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:  # a quieter logging setting must not hide it
        logger.setLevel(logging.WARNING)
    logger.addHandler(collector)
    try:
        yield failures
    finally:
        logger.removeHandler(collector)
        logger.setLevel(level)


def _summary(error: str) -> str:
    """Triton's compilation error ("at 3:73:", the function's source, the error) as its position, the
    function's first line and the error."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    header = [line for line in lines[1:-1] if line.startswith("def ")][:1]
    return "; ".join([lines[0].rstrip(":")] + header + lines[-1:]) if len(lines) > 1 else error
