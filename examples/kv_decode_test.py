"""The kv_decode example on the tiny decoder (exported at build time), on the CPU: the prefill and
every decode step agree with eager, and a decode step copies no KV cache."""

import os

import pytest
import torch

from examples import kv_decode
from examples.llama_decoder import TINY

LIBRARY = kv_decode.load_backend(os.environ["HOST_BACKEND"])
PROMPT, STEPS, MAX_CAPACITY = 6, 20, 64


@pytest.fixture(scope="module")
def report():
    return kv_decode.run_decode(LIBRARY, os.environ["TINY_PTE"], TINY, seed=0, prompt_length=PROMPT, steps=STEPS,
                                max_capacity=MAX_CAPACITY)


def test_every_step_matches_eager(report):
    # Each step's logits depend on every earlier step's K/V: a lost or misplaced write shows here.
    assert report.top1_match_rate == 1.0
    assert report.min_cosine > 0.99999


def test_a_decode_step_copies_no_kv_cache(report):
    logits_and_inputs = TINY.vocab * 4 + 2 * 8  # float32 logits out; int64 token and position in
    assert max(report.copied_bytes_per_step) == logits_and_inputs
    assert report.cache_bytes >= TINY.cache_bytes(report.capacity)


def test_the_caches_grew_past_their_initial_capacity_keeping_the_prompt(report):
    # initial capacity 8 < 26 positions: two doublings (8 -> 16 -> 32), each moving the old contents.
    assert report.length == PROMPT + STEPS
    assert report.capacity == 32
    assert report.growths == 2 * TINY.layers  # summed over the layers
    assert report.growth_bytes_moved == TINY.cache_bytes(8) + TINY.cache_bytes(16)


def test_a_lost_write_would_be_caught():
    # The agreement above means something only if a step's logits depend on the earlier steps' K/V:
    # a step after a write differs from the same step on a cache that never got that write.
    from examples.llama_decoder import LlamaDecoder

    with torch.no_grad():
        written = LlamaDecoder(TINY, max_seq=MAX_CAPACITY).eval()
        written(torch.tensor([[5]]), torch.tensor(0))
        after_write = written(torch.tensor([[9]]), torch.tensor(1))
        lost = LlamaDecoder(TINY, max_seq=MAX_CAPACITY).eval()(torch.tensor([[9]]), torch.tensor(1))
    assert not torch.allclose(after_write, lost, atol=1e-3)
