"""Zero-copy KV programs executed: AOTInductor delegates through ExecuTorch's runtime with zerokv's
C++ backend (and a host-memory CUDA allocator, so that device-planned programs run on the CPU)."""

import ctypes
import os

import pytest
import torch

from zerokv.tensorrt import testing_models as tm

TESTING = ctypes.CDLL(os.environ["ZEROKV_BACKEND_TESTING_SO"], os.RTLD_GLOBAL)
TESTING.zerokv_testing_bound_address.restype = ctypes.c_void_p
TESTING.zerokv_testing_bound_address.argtypes = [ctypes.c_char_p]
TESTING.zerokv_in_host_device_planned_memory.argtypes = [ctypes.c_void_p]
TESTING.zerokv_host_to_device_bytes.restype = ctypes.c_uint64
TESTING.zerokv_device_to_host_bytes.restype = ctypes.c_uint64
import zerokv.executorch as zx  # noqa: E402  (the backend must be registered first)

PROGRAMS = {"zero_copy": os.environ["ZERO_COPY_PTE"], "staged": os.environ["STAGED_PTE"]}


def _method(kind):
    return zx.load_program(PROGRAMS[kind]).load_method("forward")


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


CACHE_BYTES = tm.HEADS * tm.MAX_SEQ * tm.HEAD_DIM * 4  # one float32 [1, heads, positions, head_dim] cache


def _copied_bytes(method, position):
    before = TESTING.zerokv_host_to_device_bytes() + TESTING.zerokv_device_to_host_bytes()
    method.execute([STEPS[position], torch.tensor([position])])
    return TESTING.zerokv_host_to_device_bytes() + TESTING.zerokv_device_to_host_bytes() - before


def test_zero_copy_step_copies_no_cache_while_staged_copies_each_cache_twice():
    zero_copy, staged = _copied_bytes(_method("zero_copy"), 0), _copied_bytes(_method("staged"), 0)
    assert zero_copy < CACHE_BYTES, f"zero-copy step moved {zero_copy} bytes"
    assert staged >= 4 * CACHE_BYTES, f"staged step moved only {staged} bytes"  # k and v, in and out


def test_the_engine_writes_through_the_device_planned_cache():
    method = _method("zero_copy")
    method.execute([STEPS[0], torch.tensor([0])])
    for cache in ("b_layer_k_cache", "b_layer_v_cache"):
        written = TESTING.zerokv_testing_bound_address(f"{cache}_out".encode())
        assert written and written == TESTING.zerokv_testing_bound_address(cache.encode())
        assert TESTING.zerokv_in_host_device_planned_memory(written) == 1, f"{cache} is not in the planned arena"


def _file(path):
    with open(path, "rb") as f:
        return f.read()


def test_weights_are_named_data_beside_the_pte_or_in_it_when_asked():
    # The LM head's weight, byte for byte: in the data file beside the zero-copy program and not in
    # its .pte (whose delegate blob holds metadata and kernels only); in the staged program's .pte,
    # exported with named_data="pte".
    weight = tm.TinyDecoder(tm.arange_plus_offset).lm_head.weight.detach().numpy().tobytes()
    assert weight in _file(zx.data_path(PROGRAMS["zero_copy"]))
    assert weight not in _file(PROGRAMS["zero_copy"])
    assert weight in _file(PROGRAMS["staged"])
    assert not os.path.exists(zx.data_path(PROGRAMS["staged"]))
