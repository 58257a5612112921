"""Runtime-owned KV caches end to end on the CPU: a program exported with runtime_kv, executed by
ExecuTorch's runtime with zerokv's C++ backend (AOTInductor engine). Prefill, then decode far past
the caches' initial capacity (several growths), with every step's logits equal to eager; the C API's
metrics report the growths and the bytes they moved; failures and reset behave. One delegate can hold
runtime-owned and caller-owned caches together."""

import ctypes
import os

import pytest
import torch

from tests.runtime_kv import make_program as spec
from zerokv.executorch import runtime_kv_models as models


class Metrics(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("bytes_reserved", "bytes_in_use", "growths", "bytes_moved", "length", "capacity")]


BACKEND = ctypes.CDLL(os.environ["ZEROKV_BACKEND_TESTING_SO"], os.RTLD_GLOBAL)
BACKEND.zerokv_kv_metrics_sum.argtypes = [ctypes.c_char_p, ctypes.POINTER(Metrics)]
BACKEND.zerokv_kv_reset_prefix.argtypes = [ctypes.c_char_p]
from executorch.runtime import Runtime  # noqa: E402  (the backend must be registered first)

DECODE_STEPS = 40
# One position of K and V: [1, heads, 1, head_dim] float32 each.
POSITION_BYTES = 2 * models.HEADS * models.HEAD_DIM * 4
PROMPT = torch.tensor([[5, 17, 42]])
DECODED = [torch.tensor([[(7 * i + 3) % models.VOCAB]]) for i in range(DECODE_STEPS)]


def metrics():
    """The program's caches (the only ones loaded in this process), summed."""
    out = Metrics()
    assert BACKEND.zerokv_kv_metrics_sum(b"", ctypes.byref(out)) == 1, "expected one runtime-owned layer"
    return out


@pytest.fixture
def methods():
    program = Runtime.get().load_program(os.environ["RUNTIME_KV_PTE"])
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    yield prefill, decode
    del prefill, decode, program


def eager():
    """Every step's logits from the eager model over full-size caches."""
    model = models.CacheInputDecoder(seed=0).eval()
    k_cache, v_cache = models.empty_caches(spec.MAX_CAPACITY)
    with torch.no_grad():
        outputs = [model(PROMPT, torch.tensor(0), k_cache, v_cache)]
        for position, token in enumerate(DECODED, start=spec.PREFILL):
            outputs.append(model(token, torch.tensor(position), k_cache, v_cache))
    return outputs


def test_decode_past_the_initial_capacity_equals_eager_and_reports_growth(methods):
    prefill, decode = methods
    expected = eager()
    (logits,) = prefill.execute([PROMPT, torch.tensor(0)])
    torch.testing.assert_close(logits, expected[0], rtol=1e-4, atol=1e-4)
    after_prefill = metrics()
    assert (after_prefill.length, after_prefill.capacity, after_prefill.growths) == (3, 4, 0)
    for step, (position, token) in enumerate(zip(range(spec.PREFILL, 64), DECODED), start=1):
        (logits,) = decode.execute([token, torch.tensor(position)])
        torch.testing.assert_close(logits, expected[step], rtol=1e-4, atol=1e-4, msg=f"decode step {step}")

    tokens = spec.PREFILL + DECODE_STEPS
    final = metrics()
    assert final.length == tokens
    assert final.capacity == 64  # 4 -> 8 -> 16 -> 32 -> 64
    assert final.growths == 4
    assert final.bytes_moved == POSITION_BYTES * (4 + 8 + 16 + 32)
    assert final.bytes_reserved == POSITION_BYTES * 64
    assert final.bytes_in_use == POSITION_BYTES * tokens
    amortized = final.bytes_moved / tokens
    print(f"\nruntime-owned KV: {tokens} tokens, {final.growths} growths, {final.bytes_moved} bytes moved, "
          f"amortized {amortized:.1f} bytes moved per token ({POSITION_BYTES} bytes of K and V per token)")
    # Doubling keeps the amortized copy under twice a token's own K and V bytes.
    assert amortized < 2 * POSITION_BYTES


def test_a_step_past_max_capacity_is_refused_and_advances_nothing(methods):
    prefill, decode = methods
    prefill.execute([PROMPT, torch.tensor(0)])
    for position in range(spec.PREFILL, spec.MAX_CAPACITY):
        decode.execute([DECODED[0], torch.tensor(position)])
    assert metrics().length == spec.MAX_CAPACITY
    with pytest.raises(RuntimeError):
        decode.execute([DECODED[0], torch.tensor(spec.MAX_CAPACITY)])
    assert metrics().length == spec.MAX_CAPACITY


def test_reset_starts_a_fresh_sequence_on_the_kept_storage(methods):
    prefill, decode = methods
    expected = eager()
    prefill.execute([torch.tensor([[1, 2, 3]]), torch.tensor(0)])
    for position in range(spec.PREFILL, 20):
        decode.execute([DECODED[1], torch.tensor(position)])
    assert BACKEND.zerokv_kv_reset_prefix(b"") == 1
    after_reset = metrics()
    assert (after_reset.length, after_reset.bytes_in_use, after_reset.capacity) == (0, 0, 32)
    (logits,) = prefill.execute([PROMPT, torch.tensor(0)])
    torch.testing.assert_close(logits, expected[0], rtol=1e-4, atol=1e-4)
    (logits,) = decode.execute([DECODED[0], torch.tensor(spec.PREFILL)])
    torch.testing.assert_close(logits, expected[1], rtol=1e-4, atol=1e-4)


def test_one_delegate_writing_runtime_owned_and_caller_owned_caches_equals_eager():
    method = Runtime.get().load_program(os.environ["MIXED_KV_PTE"]).load_method("decode")
    model = models.MixedCacheDecoder(seed=0).eval()
    k_cache, v_cache = models.empty_caches(spec.MIXED_MAX_CAPACITY)
    with torch.no_grad():
        for position, token in enumerate(DECODED[:spec.MIXED_MAX_CAPACITY]):
            expected = model(token, torch.tensor(position), k_cache, v_cache)
            (logits,) = method.execute([token, torch.tensor(position)])
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=f"step {position}")
    assert metrics().length == spec.MIXED_MAX_CAPACITY
