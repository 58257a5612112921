"""Hugging Face decoders of three families (small random configs: Llama-3 with grouped-query
attention, Qwen3 with q/k norms, Gemma-3 with sliding-window and global layers), exported at build
time with a dynamic-length prefill and a decode method over runtime-owned caches, run through the
ExecuTorch runtime with zerokv's backend (AOTInductor on the CPU): 32 greedy steps equal
transformers' eager ones, every step's logits at cosine >= 0.9999, no cache copied per step, and
ExecuTorch's LLM metadata methods in the .pte. Gemma-3's sliding layers are ring caches the decode
and a chunked prefill wrap several times. Then the example end to end on a checkpoint this test
writes with save_pretrained."""

import os
import subprocess

import pytest
import torch
from executorch.exir._serialize._program import deserialize_pte_binary

from zerokv import blob

from examples import hf_decode
from examples.backend_library import load_backend
from zerokv.executorch import hf_decoders as hf

LIBRARY = load_backend(os.environ["HOST_BACKEND"])
import zerokv.executorch as zx  # noqa: E402  (the backend must be registered first)

PTE_DIR = os.path.dirname(os.environ["PTE_DIR"])
PROMPT = [5, 17, 42, 9, 3, 77]
STEPS = 32
MAX_CAPACITY = 128  # hf_decode's default, which the build-time programs were exported with
GEMMA3_MAX_PREFILL = 8  # the gemma3 program's --max_prefill (BUILD.bazel): a ring the decode wraps often


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_greedy_decode_equals_eager(family):
    model = hf.tiny(family)
    report = hf_decode.run_decode(LIBRARY, os.path.join(PTE_DIR, f"hf_decode_{family}.pte"), model, PROMPT, STEPS)
    assert report.tokens == report.eager_tokens
    assert min(report.cosines) >= 0.9999, report.cosines
    # A step moves its token, position (and ring slots) in and its logits out; the caches stay where
    # they are.
    inputs = len(hf.step_inputs(model.config, torch.tensor([[0]])))
    assert max(report.copied_bytes_per_step) == model.config.vocab_size * 4 + inputs * 8
    print(f"\n{family}: {report.tokens_per_second:.1f} tokens/s, min cosine {min(report.cosines):.7f}")


def test_gemma3_decodes_past_its_sliding_window():
    # The agreement above covers the sliding layers only if the decode goes past their window.
    config = hf.tiny("gemma3").config
    assert any(hf.sliding_layers(config)) and not all(hf.sliding_layers(config))
    assert len(PROMPT) + STEPS > 2 * config.sliding_window


def test_gemma3_chunked_prefills_over_a_wrapped_ring_equal_one_eager_forward():
    # Prefills of the widest step (8 tokens) after the ring has wrapped: each writes its positions
    # before it attends, so a ring one slot short would overwrite keys its first queries need.
    model = hf.tiny("gemma3")
    program = zx.load_program(os.path.join(PTE_DIR, "hf_decode_gemma3.pte"))
    prefill = program.load_method("prefill")
    chunks = [PROMPT, [11, 23, 4, 60, 8, 31, 2, 99], [7, 64, 12, 5, 88, 3, 41, 19], [50, 6]]
    tokens = [token for chunk in chunks for token in chunk]
    assert max(map(len, chunks)) == GEMMA3_MAX_PREFILL
    assert len(tokens) > 2 * (model.config.sliding_window + GEMMA3_MAX_PREFILL - 1)
    with torch.no_grad():
        eager = model(input_ids=torch.tensor([tokens])).logits[0]
    start = 0
    for chunk in chunks:
        (logits,) = prefill.execute(hf.step_inputs(model.config, torch.tensor([chunk])))
        cosines = torch.nn.functional.cosine_similarity(logits[0], eager[start:start + len(chunk)], dim=-1)
        assert cosines.min() >= 0.9999, (start, cosines)
        start += len(chunk)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_cache_inputs_over_rings_equal_one_eager_forward(attention):
    # CacheInputs itself (not exported) over rings the test fills as the runtime does, with both mask
    # formats transformers' mask interface produces (sdpa: boolean; eager: additive float).
    model = hf.tiny("gemma3")
    model.config._attn_implementation = attention
    slots = hf.ring_slots(model.config, MAX_CAPACITY, GEMMA3_MAX_PREFILL)
    caches = [torch.zeros(hf.cache_shape(model.config, slots if sliding else MAX_CAPACITY))
              for sliding in hf.sliding_layers(model.config) for _ in "kv"]
    chunks = [PROMPT, [11, 23, 4, 60, 8, 31, 2, 99], *([token] for token in range(40, 60))]
    tokens = [token for chunk in chunks for token in chunk]
    wrapper = hf.CacheInputs(model)
    with torch.no_grad():
        eager = model(input_ids=torch.tensor([tokens])).logits[0]
        start = 0
        for chunk in chunks:
            positions = torch.arange(len(chunk)) + start
            logits = wrapper(torch.tensor([chunk]), positions, *caches, ring_slots=positions % slots)
            cosines = torch.nn.functional.cosine_similarity(logits[0], eager[start:start + len(chunk)], dim=-1)
            assert cosines.min() >= 0.9999, (start, cosines)
            start += len(chunk)
    assert start > 3 * slots


def test_a_ring_that_cannot_hold_a_prefill_is_refused_by_layer():
    # Every layer sliding: no global layer bounds the positions, so the ring must hold window +
    # max_prefill - 1 slots, here more than max_capacity.
    model = hf.tiny("gemma3")
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    with pytest.raises(zx.ZeroKVError, match=r"sliding layers \[0, 1, 2, 3\]: a ring for window 4 and prefills "
                                              r"of 32 tokens needs 35 slots, more than max_capacity 16"):
        hf.export_programs(model, max_capacity=16, max_prefill=32, initial_capacity=16)
    # With a global layer, positions stop below max_capacity: a ring of max_capacity never wraps.
    assert hf.ring_slots(hf.tiny("gemma3").config, max_capacity=16, max_prefill=32) == 16


def test_a_layer_type_without_a_mask_here_is_refused():
    model = hf.tiny("gemma3")
    model.config.layer_types = ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]
    with pytest.raises(zx.ZeroKVError, match=r"layer types \['chunked_attention'\] have no mask here"):
        hf.CacheInputs(model)


def _kv_manifests(path):
    """{method: {model layer: its KV manifest entry}} of the zerokv delegates of a .pte. A layer's
    storage key ends with its K and V method inputs, "caches_<2 * layer>+caches_<2 * layer + 1>"."""
    with open(path, "rb") as f:
        program = deserialize_pte_binary(f.read()).program
    manifests = {}
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            parsed = blob.parse(program.backend_delegate_data[delegate.processed.index].data)
            for layer in parsed.metadata.kv_layers:
                k_input = layer.storage_key.split("/")[-1].split("+")[0]
                manifests.setdefault(plan.name, {})[int(k_input.removeprefix("caches_")) // 2] = layer
    return manifests


def test_gemma3_sliding_layers_are_rings_and_global_layers_flat():
    config = hf.tiny("gemma3").config
    # A prefill of T tokens writes before it attends: its first query needs the W - 1 positions
    # before it, so the ring holds W + T_max - 1 slots, far fewer than the global layer's capacity.
    ring = config.sliding_window + GEMMA3_MAX_PREFILL - 1
    assert ring < MAX_CAPACITY and len(PROMPT) + STEPS > 3 * ring
    manifests = _kv_manifests(os.path.join(PTE_DIR, "hf_decode_gemma3.pte"))
    assert set(manifests) == {"prefill", "decode"}
    for method, layers in manifests.items():
        assert sorted(layers) == list(range(config.num_hidden_layers)), method
        for index, sliding in enumerate(hf.sliding_layers(config)):
            layer = layers[index]
            if sliding:
                assert (layer.policy, layer.window, layer.initial_capacity) == (blob.KVPolicy.RING, ring, ring), (
                    method, index, layer)
                assert layer.slots_binding, (method, index)
            else:
                assert (layer.policy, layer.max_capacity) == (blob.KVPolicy.FLAT, MAX_CAPACITY), (method, index)


def test_the_program_carries_the_llm_metadata_methods():
    program = zx.load_program(os.path.join(PTE_DIR, "hf_decode_llama.pte"))
    model = hf.tiny("llama")
    expected = hf.constant_methods(model, MAX_CAPACITY)
    assert set(program.method_names) == {"prefill", "decode", *expected}
    for name, value in expected.items():
        outputs = program.load_method(name).execute([])
        values = [output.item() if isinstance(output, torch.Tensor) else output for output in outputs]
        assert values == (value if isinstance(value, list) else [value]), name
    assert expected["get_max_seq_len"] == MAX_CAPACITY
    assert expected["get_vocab_size"] == model.config.vocab_size


def test_the_example_on_a_local_checkpoint(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    hf.tiny("qwen3", seed=7).save_pretrained(checkpoint)
    assert any(name.endswith(".safetensors") for name in os.listdir(checkpoint))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    result = subprocess.run([os.environ["HF_DECODE"], f"--checkpoint={checkpoint}", "--steps=8",
                             f"--host_backend_library={os.environ['HOST_BACKEND']}"],
                            capture_output=True, text=True, env=env, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    print(result.stdout)
    assert "model: qwen3, 2 layers" in result.stdout
    assert "greedy tokens 9/9 equal" in result.stdout
    assert "tokens/s" in result.stdout and "bytes copied host<->device per decode step: max 528" in result.stdout
