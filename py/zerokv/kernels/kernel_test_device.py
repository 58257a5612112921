"""Where the matrix-vector kernels' tests run: compiled on a CUDA device (the gpu-tagged twin), or on
the CPU under Triton's interpreter (TRITON_INTERPRET=1, which the interpreted target sets); a
machine with neither skips the test module, saying why."""

import pytest
import torch

from zerokv.kernels import matvec as mv


def device_or_skip() -> str:
    if mv.INTERPRETED:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device, and Triton's interpreter is off (TRITON_INTERPRET=1 runs the kernel on the CPU)",
                allow_module_level=True)
