"""Runtime-owned KV caches end to end on the CPU: a program exported with runtime_kv, executed by
ExecuTorch's runtime with zerokv's C++ backend (AOTInductor engine). Prefill, then decode far past
the caches' initial capacity (several growths), with every step's logits equal to eager; the C API's
metrics report the growths and the bytes they moved; failures and reset behave; the runtime, not the
caller, supplies each step's position; two loads of the program are isolated sequences; one delegate
can hold runtime-owned and caller-owned caches together."""

import ctypes
import os

import pytest
import torch

from tests.runtime_kv import make_program as spec
from zerokv.executorch import runtime_kv_models as models


class Metrics(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("bytes_reserved", "bytes_in_use", "growths", "bytes_moved", "length", "capacity", "position")]


BACKEND = ctypes.CDLL(os.environ["ZEROKV_BACKEND_TESTING_SO"], os.RTLD_GLOBAL)
BACKEND.zerokv_kv_sequence_create.restype = ctypes.c_void_p
BACKEND.zerokv_kv_implicit_sequence.restype = ctypes.c_void_p
BACKEND.zerokv_kv_sequence_release.argtypes = [ctypes.c_void_p]
BACKEND.zerokv_kv_sequence_select.argtypes = [ctypes.c_void_p]
BACKEND.zerokv_kv_sequence_metrics.argtypes = [ctypes.c_void_p, ctypes.POINTER(Metrics)]
BACKEND.zerokv_kv_sequence_reset.argtypes = [ctypes.c_void_p]
import zerokv.executorch as zx  # noqa: E402  (the backend must be registered first)

DECODE_STEPS = 40
# One position of K and V: [1, heads, 1, head_dim] float32 each.
POSITION_BYTES = 2 * models.HEADS * models.HEAD_DIM * 4
PROMPT = torch.tensor([[5, 17, 42]])
DECODED = [torch.tensor([[(7 * i + 3) % models.VOCAB]]) for i in range(DECODE_STEPS)]


def metrics(sequence=None):
    """The caches of `sequence`, by default the implicit one (the program loaded without one)."""
    handle = sequence or BACKEND.zerokv_kv_implicit_sequence()
    assert handle, "no program is loaded without a sequence"
    out = Metrics()
    caches = BACKEND.zerokv_kv_sequence_metrics(handle, ctypes.byref(out))
    if sequence is None:
        BACKEND.zerokv_kv_sequence_release(handle)
    assert caches == 1, "expected one runtime-owned layer"
    return out


def reset(sequence=None):
    handle = sequence or BACKEND.zerokv_kv_implicit_sequence()
    result = BACKEND.zerokv_kv_sequence_reset(handle)
    if sequence is None:
        BACKEND.zerokv_kv_sequence_release(handle)
    return result


def load(sequence=None):
    """prefill and decode of a new load of the program, at home in `sequence` (None: the implicit one)."""
    BACKEND.zerokv_kv_sequence_select(sequence)
    try:
        program = zx.load_program(os.environ["RUNTIME_KV_PTE"])
        return program, program.load_method("prefill"), program.load_method("decode")
    finally:
        BACKEND.zerokv_kv_sequence_select(None)


@pytest.fixture
def methods():
    program, prefill, decode = load()
    yield prefill, decode
    del prefill, decode, program


def eager(prompt=PROMPT):
    """Every step's logits from the eager model over full-size caches."""
    model = models.CacheInputDecoder(seed=0).eval()
    k_cache, v_cache = models.empty_caches(spec.MAX_CAPACITY)
    with torch.no_grad():
        outputs = [model(prompt, torch.tensor(0), k_cache, v_cache)]
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
    assert reset() == 0
    after_reset = metrics()
    assert (after_reset.length, after_reset.bytes_in_use, after_reset.capacity) == (0, 0, 32)
    (logits,) = prefill.execute([PROMPT, torch.tensor(0)])
    torch.testing.assert_close(logits, expected[0], rtol=1e-4, atol=1e-4)
    (logits,) = decode.execute([DECODED[0], torch.tensor(spec.PREFILL)])
    torch.testing.assert_close(logits, expected[1], rtol=1e-4, atol=1e-4)


def test_one_delegate_writing_runtime_owned_and_caller_owned_caches_equals_eager():
    method = zx.load_program(os.environ["MIXED_KV_PTE"]).load_method("decode")
    model = models.MixedCacheDecoder(seed=0).eval()
    k_cache, v_cache = models.empty_caches(spec.MIXED_MAX_CAPACITY)
    with torch.no_grad():
        for position, token in enumerate(DECODED[:spec.MIXED_MAX_CAPACITY]):
            expected = model(token, torch.tensor(position), k_cache, v_cache)
            (logits,) = method.execute([token, torch.tensor(position)])
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=f"step {position}")
    assert metrics().length == spec.MIXED_MAX_CAPACITY


def test_the_runtime_supplies_the_position_whatever_the_caller_passes(methods):
    prefill, decode = methods
    expected = eager()
    prefill.execute([PROMPT, torch.tensor(0)])
    for step, position in enumerate(range(spec.PREFILL, 6), start=1):
        decode.execute([DECODED[step - 1], torch.tensor(position)])
    assert metrics().length == 6
    # The caller claims position 2: the runtime writes (and attends at) position 6 all the same.
    (logits,) = decode.execute([DECODED[3], torch.tensor(2)])
    torch.testing.assert_close(logits, expected[4], rtol=1e-4, atol=1e-4)
    assert metrics().length == 7


def test_two_loads_are_isolated_sequences():
    """Sequence A decodes; sequence B, a second load of the same .pte, prefills another prompt in
    between; A's next steps still equal eager, and B's its own."""
    a, b = BACKEND.zerokv_kv_sequence_create(), BACKEND.zerokv_kv_sequence_create()
    other_prompt = torch.tensor([[9, 8, 7]])
    expected_a, expected_b = eager(), eager(other_prompt)
    program_a, prefill_a, decode_a = load(a)
    program_b, prefill_b, decode_b = load(b)
    try:
        (logits,) = prefill_a.execute([PROMPT, torch.tensor(0)])
        torch.testing.assert_close(logits, expected_a[0], rtol=1e-4, atol=1e-4)
        for step in range(1, 4):
            (logits,) = decode_a.execute([DECODED[step - 1], torch.tensor(spec.PREFILL + step - 1)])
            torch.testing.assert_close(logits, expected_a[step], rtol=1e-4, atol=1e-4, msg=f"A step {step}")
        (logits,) = prefill_b.execute([other_prompt, torch.tensor(0)])
        torch.testing.assert_close(logits, expected_b[0], rtol=1e-4, atol=1e-4, msg="B's prefill")
        for step in range(4, 8):
            (logits,) = decode_a.execute([DECODED[step - 1], torch.tensor(spec.PREFILL + step - 1)])
            torch.testing.assert_close(logits, expected_a[step], rtol=1e-4, atol=1e-4, msg=f"A step {step}")
        (logits,) = decode_b.execute([DECODED[0], torch.tensor(spec.PREFILL)])
        torch.testing.assert_close(logits, expected_b[1], rtol=1e-4, atol=1e-4, msg="B's first decode")
        assert metrics(a).length == spec.PREFILL + 7
        assert metrics(b).length == spec.PREFILL + 1
        assert reset(b) == 0
        assert (metrics(b).length, metrics(a).length) == (0, spec.PREFILL + 7)
    finally:
        del prefill_a, decode_a, program_a, prefill_b, decode_b, program_b
        BACKEND.zerokv_kv_sequence_release(a)
        BACKEND.zerokv_kv_sequence_release(b)


def test_a_second_load_without_a_sequence_is_refused(methods):
    """Both loads would run at home in the implicit sequence, sharing (and corrupting) one cache."""
    prefill, decode = methods
    prefill.execute([PROMPT, torch.tensor(0)])
    program = zx.load_program(os.environ["RUNTIME_KV_PTE"])
    with pytest.raises(RuntimeError):
        program.load_method("decode")
    assert metrics().length == spec.PREFILL
    (logits,) = decode.execute([DECODED[0], torch.tensor(spec.PREFILL)])
    torch.testing.assert_close(logits, eager()[1], rtol=1e-4, atol=1e-4)


def test_a_ring_cache_is_written_at_the_runtimes_slots():
    """20 one-token steps over a ring of 8 slots (it wraps twice); the caller's position and slots
    are wrong on purpose. Eager runs the same model with slots = position mod 8."""
    sequence = BACKEND.zerokv_kv_sequence_create()
    BACKEND.zerokv_kv_sequence_select(sequence)
    try:
        program = zx.load_program(os.environ["RUNTIME_KV_RING_PTE"])
        decode = program.load_method("decode")
    finally:
        BACKEND.zerokv_kv_sequence_select(None)
    model = spec.RingDecoder(seed=0).eval()
    k_cache, v_cache = models.empty_caches(spec.WINDOW)
    try:
        for position in range(20):
            token = DECODED[position]
            with torch.no_grad():
                expected = model(token, torch.tensor(position), torch.tensor([position % spec.WINDOW]), k_cache, v_cache)
            (logits,) = decode.execute([token, torch.tensor(3), torch.tensor([5])])
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=f"position {position}")
        ring = metrics(sequence)
        assert (ring.length, ring.position, ring.capacity, ring.growths) == (spec.WINDOW, 20, spec.WINDOW, 0)
    finally:
        del decode, program
        BACKEND.zerokv_kv_sequence_release(sequence)
