"""Where the kernels' tests run: compiled on a CUDA device (the gpu-tagged twin), or on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, which the interpreted target sets); a machine with neither
skips the test module, saying why. An H200 for Triton on a machine without a GPU, and a kernel
Inductor's analysis of user kernels cannot compile."""

import contextlib

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from zerokv.kernels import matvec as mv

H200 = GPUTarget("cuda", 90, 32)


def device_or_skip() -> str:
    if mv.INTERPRETED:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device, and Triton's interpreter is off (TRITON_INTERPRET=1 runs the kernel on the CPU)",
                allow_module_level=True)


@contextlib.contextmanager
def an_h200_for_triton():
    """Triton's active driver reports the H200's target (Inductor's analysis of a user kernel asks
    it), on a machine without a GPU."""
    class H200Driver:
        def get_current_target(self):
            return H200

    # Put back as it was: this machine has no driver for reset_active() to find.
    active = triton.runtime.driver._active
    triton.runtime.driver.set_active(H200Driver())
    try:
        yield
    finally:
        triton.runtime.driver._active = active


@triton.jit
def unanalyzable_kernel(X, N: tl.constexpr):
    tl.store(X, N.to(tl.float32))  # an integer constant has no .to: the kernel does not compile
