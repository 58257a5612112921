"""Programmatic dependent launch: in a decode step's CUDA graph, a zerokv kernel may start before the
kernel before it has ended.

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

Inductor's own pointwise and reduction kernels (the norms, the rotary embedding, the cache writes:
INDUCTOR_KERNELS) take such edges too, compiled with Inductor's PDL code (triton.enable_pdl, which
zerokv.aoti.compile_aoti sets where it names them). Inductor puts a kernel's wait before its first
access to anything the kernel it scheduled before it touches, and before its first access at all
when that one was not one of its own Triton kernels (a zerokv kernel, any extern call: its
scheduler forgets the previous node then); the kernel signals only after its wait. So what such a
kernel reads or writes before its wait was last touched by a kernel that completed before the one
it follows signalled: Inductor's kernel signalled after its own wait, and a kernel that does not
signal (an extern one) launched only once everything before it had ended. A zerokv kernel signals
as it starts, but the Inductor kernel after it waits before any access. Templates (triton_tem_,
Inductor's matrix products) have no PDL code and are not named.

The zerokv AOTInductor engine makes the edges into these kernels programmatic in the step's CUDA
graph (cc/engines/aoti/dependent_launch.h: the names come from the package's metadata, which
zerokv.aoti.compile_aoti writes from early_kernels); every other edge stays as it was captured.
Elsewhere (no programmatic edge, or an older GPU) the kernels run as before: the wait and the signal
do nothing.
"""

from __future__ import annotations

import torch

# The kernels' entry names (Triton names a kernel after its function; compile_aoti keeps them).
KERNELS = ("_matvec_kernel", "_siblings_kernel", "_split_kernel", "_combine_kernel")
# Inductor's pointwise, reduction and persistent reduction kernels, by the beginning of their names
# (cc/engines/aoti/dependent_launch.h: an entry ending in '*').
INDUCTOR_KERNELS = ("triton_poi_*", "triton_red_*", "triton_per_*")
MIN_CAPABILITY = (9, 0)


def supported(device: torch.device) -> bool:
    """Whether kernels compiled for `device` can take programmatic edges (the wait and signal exist
    from sm_90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def early_kernels(device: torch.device) -> tuple[str, ...]:
    """The kernels a package compiled for `device` may let launch early: none before sm_90."""
    return KERNELS + INDUCTOR_KERNELS if supported(device) else ()
