"""Programmatic dependent launch: in a decode step's CUDA graph, zerokv's kernels and Inductor's
may start before the kernel before them has ended.

On sm_90 and later, an edge of a CUDA graph between two kernels can be programmatic: the second
kernel launches once every block of the first has signalled (griddepcontrol.launch_dependents) or
ended, and its griddepcontrol.wait returns once the first has completed with its writes visible.
A step is a chain of short kernels, and each one's launch and first loads otherwise wait for the
whole of the one before it. The kernels named in KERNELS read nothing that a kernel of the step
may write before their wait, and write nothing before it; the products whose weights are the
program's constants (zerokv.kernels.constant_weights) load their first tile of them before it, so
the weights stream while the kernel before them drains. On the H200, a chain of 48 products of
Llama-3.2-1B's MLP and output shapes took 423 us as plain launches and 313 us with programmatic
edges and that early tile; in the 1B decode step the bare engine was 1-3% faster.

Inductor's own pointwise and reduction kernels (the norms, the rotary embedding, the cache writes)
take such edges too, compiled with Inductor's PDL code (triton.enable_pdl, which
zerokv.aoti.compile_aoti sets where it may name them). Inductor puts a kernel's wait before its
first access to anything the kernel it scheduled just before touches, and before any access at all
when that one was not one of its own Triton kernels (a zerokv kernel, any extern call: its
scheduler forgets the previous node then); the kernel signals only after its wait. What such a
kernel touches before its wait was therefore last touched by a kernel that completed before the
one it follows signalled or ended: that one, if it is Inductor's, signals only after its wait
returned; if it does not signal, it is behind a plain edge or waits before it ends. A zerokv
kernel signals as it starts, but the Inductor kernel after it waits before any access.
//py/zerokv/aoti:inductor_kernels_gpu_test checks both in the GPU machine's Inductor. A kernel
behind such an edge must wait somewhere: one that did not could end before the kernel it follows,
and the kernel after it, launched at its end, would not be ordered after that one. So
waiting_inductor_kernels names only the kernels that wait, and signal after it. A combo kernel
(compile_aoti compiles with them) runs each of the kernels it combines in a branch on the program's
id, and each branch waits and signals on its own: one is named only if every branch that signals
waits first and one branch at least waits (its programs are then still running when the kernel it
follows ends, and the kernel after it launches once every program has signalled or ended). Templates
(triton_tem_, Inductor's matrix products) have no PDL code. With Inductor's kernels behind such
edges too, the 1B step's bare engine was another 3-6% faster.

The zerokv AOTInductor engine makes the edges into these kernels programmatic in the step's CUDA
graph (cc/engines/aoti/dependent_launch.h: the names come from the package's metadata, which
zerokv.aoti.compile_aoti writes from early_kernels); every other edge stays as it was captured.
Elsewhere (no programmatic edge, or an older GPU) the kernels run as before: the wait and the signal
do nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

# The kernels' entry names (Triton names a kernel after its function; compile_aoti keeps them).
KERNELS = ("_matvec_kernel", "_siblings_kernel", "_split_kernel", "_combine_kernel")
# What Inductor names its pointwise, reduction and persistent reduction kernels with, before what
# they compute.
INDUCTOR_KINDS = ("triton_poi_", "triton_red_", "triton_per_")
MIN_CAPABILITY = (9, 0)
# How a combo kernel starts the branch of each kernel it combines: `if pid < num_xblocks_0:`, then
# `elif pid < num_xblocks_1:`...
_COMBO_BRANCH = re.compile(r"^\s*(?:el)?if pid\b")


def supported(device: torch.device) -> bool:
    """Whether kernels compiled for `device` can take programmatic edges (the wait and signal exist
    from sm_90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def waiting_inductor_kernels(sources: Mapping[str, str]) -> tuple[str, ...]:
    """Of Inductor's kernels ({name: Triton source}), the pointwise and reduction ones that wait for
    the kernel before them, and signal the kernel after them only after that wait."""
    def waits_first(source):
        waits, signals = [], []
        for lines in branches(source):
            waits.append(next((i for i, line in enumerate(lines) if "gdc_wait(" in line), None))
            signals.append(next((i for i, line in enumerate(lines) if "gdc_launch_dependents(" in line), None))
        return any(wait is not None for wait in waits) and all(
            signal is None or (wait is not None and wait < signal) for wait, signal in zip(waits, signals))

    return tuple(sorted(name for name, source in sources.items()
                        if name.startswith(INDUCTOR_KINDS) and waits_first(source)))


def branches(source: str) -> list[list[str]]:
    """A Triton kernel's source as the lines its programs may run: the whole of it, or for a combo
    kernel each branch after the lines before the first."""
    lines = source.splitlines()
    starts = [i for i, line in enumerate(lines) if _COMBO_BRANCH.match(line)]
    if not starts:
        return [lines]
    return [lines[:starts[0]] + lines[start:end] for start, end in zip(starts, starts[1:] + [len(lines)])]


def early_kernels(device: torch.device, inductor_sources: Mapping[str, str]) -> tuple[str, ...]:
    """The kernels a package compiled for `device` may let launch early: zerokv's and Inductor's
    waiting ones (`inductor_sources`: the kernels Inductor wrote for it); none before sm_90."""
    return KERNELS + waiting_inductor_kernels(inductor_sources) if supported(device) else ()
