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

The zerokv AOTInductor engine makes the edges into these kernels programmatic in the step's CUDA
graph (cc/engines/aoti/dependent_launch.h: the names come from the package's metadata, which
zerokv.aoti.compile_aoti writes from KERNELS); every other edge stays as it was captured. Elsewhere
(no programmatic edge, or an older GPU) the kernels run as before: the wait and the signal do
nothing.
"""

from __future__ import annotations

import torch

# The kernels' entry names (Triton names a kernel after its function; compile_aoti keeps them).
KERNELS = ("_matvec_kernel", "_siblings_kernel", "_split_kernel", "_combine_kernel")
MIN_CAPABILITY = (9, 0)


def supported(device: torch.device) -> bool:
    """Whether kernels compiled for `device` can take programmatic edges (the wait and signal exist
    from sm_90)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY
