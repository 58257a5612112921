"""The persistent decode step against transformers' own, on an sm_90 GPU: logits, the K and V rows
written in every layer, the rows left alone, the input guards, the same bits from the same inputs, and
the step replayed as a CUDA graph."""

import os

import pytest
import torch

from cc.engines.megakernel import llama_decode_step as megakernel
from tools.bench import static_cache

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU (the step is sm_90a code)", allow_module_level=True)
transformers = pytest.importorskip("transformers")

LIBRARY = os.environ["ZEROKV_MEGAKERNEL_LIBRARY"]

# A small model with many attention splits per KV head (2 KV heads over the GPU's SMs), and the
# Llama-3.2-1B layer shape (its rotary scaling, tied embeddings), two layers of it.
SMALL = dict(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False)
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=8192))
POSITIONS = [0, 1, 63, 64, 65, 127, 128, 129, 1000, 2047, 2048, 4095]


def _model_and_caches(shape, capacity):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model = model.to(torch.bfloat16).eval()
    cache = static_cache.allocated(model, capacity)
    for layer in cache.layers:  # a history to attend over, the same in both caches
        layer.keys.normal_()
        layer.values.normal_()
    keys = [layer.keys[0].clone() for layer in cache.layers]
    values = [layer.values[0].clone() for layer in cache.layers]
    return model, cache, keys, values


@pytest.fixture(scope="module")
def library():
    return megakernel.load(LIBRARY)


@pytest.mark.parametrize("shape", [SMALL, LLAMA_3_2_1B], ids=["small", "llama-3.2-1b-layers"])
def test_matches_transformers(library, shape):
    model, cache, keys, values = _model_and_caches(shape, 4096)
    step = megakernel.LlamaDecodeStep(library, model, keys, values)
    reference = megakernel.float32_reference(model, cache)
    failures = megakernel.check_against_transformers(model, step, cache, keys, values, POSITIONS, reference)
    assert not failures, "\n".join(failures)
    assert step.error_word() == 0


def test_refuses_positions_and_tokens_outside_the_cache_and_vocabulary(library):
    model, _, keys, values = _model_and_caches(SMALL, 1024)
    step = megakernel.LlamaDecodeStep(library, model, keys, values)
    failures = megakernel.check_refusals(step, keys, values)
    assert not failures, "\n".join(failures)


def test_the_same_inputs_give_the_same_bits(library):
    # 16 KV heads share an H100's or H200's 132 SMs 8 splits a head, so that at 8000 each split folds
    # 16 tiles and a race between a tile's readers and its slot's refill has many chances to show.
    # (Without the slot's proxy fence, 10 launches here differed in 2 of 3 tries on an H100; hence 50.)
    model, _, keys, values = _model_and_caches(dict(SMALL, num_attention_heads=64, num_key_value_heads=16), 8192)
    step = megakernel.LlamaDecodeStep(library, model, keys, values)
    failures = megakernel.check_repeatable(step, keys, values, positions=(700, 8000), launches=50)
    assert not failures, "\n".join(failures)


def test_graph_replay_reads_the_position_it_is_given(library):
    model, _, keys, values = _model_and_caches(SMALL, 1024)
    step = megakernel.LlamaDecodeStep(library, model, keys, values)
    eager = {}
    for position in (10, 700):
        step.token.fill_(3)
        step.position.fill_(position)
        step.launch()
        torch.cuda.synchronize()
        eager[position] = (step.logits.clone(), keys[1][:, position].clone())
        keys[1][:, position].zero_()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step.launch()
    for position in (700, 10):
        step.position.fill_(position)
        graph.replay()
        torch.cuda.synchronize()
        logits, row = eager[position]
        # Every sum runs in one order (no atomics), so the same inputs give the same bits.
        assert torch.equal(step.logits, logits), f"position {position}: the replay's logits are not a launch's"
        assert torch.equal(keys[1][:, position], row), f"position {position}: the replay's K row is not a launch's"
    assert not torch.allclose(eager[10][0], eager[700][0], rtol=2e-2, atol=2e-2), "the positions' logits are alike"
