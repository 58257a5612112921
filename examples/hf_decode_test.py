"""Hugging Face decoders of three families (small random configs: Llama-3 with grouped-query
attention, Qwen3 with q/k norms, Gemma-3 with sliding-window and global layers), exported at build
time with a dynamic-length prefill and a decode method over runtime-owned caches, run through the
ExecuTorch runtime with zerokv's backend (AOTInductor on the CPU): 32 greedy steps equal
transformers' eager ones, every step's logits at cosine >= 0.9999, no cache copied per step, and
ExecuTorch's LLM metadata methods in the .pte. Then the example end to end on a checkpoint this
test writes with save_pretrained."""

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
    # A step moves its token and position in and its logits out; the caches stay where they are.
    assert max(report.copied_bytes_per_step) == model.config.vocab_size * 4 + 2 * 8
    print(f"\n{family}: {report.tokens_per_second:.1f} tokens/s, min cosine {min(report.cosines):.7f}")


def test_gemma3_decodes_past_its_sliding_window():
    # The agreement above covers the sliding layers only if the decode goes past their window.
    config = hf.tiny("gemma3").config
    assert any(hf.sliding_layers(config)) and not all(hf.sliding_layers(config))
    assert len(PROMPT) + STEPS > 2 * config.sliding_window


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
