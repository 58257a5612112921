"""Zero-copy KV programs executed: AOTInductor delegates through ExecuTorch's runtime with zerokv's
C++ backend (and a host-memory CUDA allocator, so that device-planned programs run on the CPU)."""

import ctypes
import os

import pytest
import torch

from zerokv.tensorrt import testing_models as tm

ctypes.CDLL(os.environ["ZEROKV_BACKEND_TESTING_SO"], os.RTLD_GLOBAL)
from executorch.runtime import Runtime  # noqa: E402  (the backend must be registered first)

PROGRAMS = {"zero_copy": os.environ["ZERO_COPY_PTE"], "staged": os.environ["STAGED_PTE"]}


def _method(kind):
    return Runtime.get().load_program(PROGRAMS[kind]).load_method("forward")


def _eager_steps(steps):
    model = tm.TinyDecoder(tm.arange_plus_offset).eval()
    with torch.no_grad():
        return [model(ids, torch.tensor([position])) for position, ids in enumerate(steps)]


STEPS = [torch.tensor([[7]]), torch.tensor([[19]]), torch.tensor([[3]])]


@pytest.mark.parametrize("kind", sorted(PROGRAMS))
def test_each_step_sees_the_kv_the_previous_step_wrote(kind):
    method = _method(kind)
    expected = _eager_steps(STEPS)
    for position, (ids, reference) in enumerate(zip(STEPS, expected)):
        (logits,) = method.execute([ids, torch.tensor([position])])
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4, msg=f"{kind} step {position}")


def test_a_lost_write_would_be_caught():
    # The last step alone, on a fresh cache, differs from the last step after the others: the test
    # above can only pass if the earlier steps' writes reached the cache.
    method = _method("zero_copy")
    (alone,) = method.execute([STEPS[-1], torch.tensor([len(STEPS) - 1])])
    assert not torch.allclose(alone, _eager_steps(STEPS)[-1], rtol=1e-4, atol=1e-4)
