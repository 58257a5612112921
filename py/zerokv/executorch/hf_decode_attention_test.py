"""Split-K decode attention: what it leaves to transformers' SDPA and what it refuses. The kernels
are checked against SDPA in //py/zerokv/kernels:flash_decode_test, and the compiled decoder against
eager by //tools/bench:decode_roofline on the GPU."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from zerokv.executorch import hf_decoders as hf
from zerokv.executorch.hf_decode_attention import DecodeAttentionError, splitk_decode_attention, use_splitk_decode


def _qkv(tokens, capacity=8, heads=4, kv_heads=2, head_dim=16):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(1, heads, tokens, head_dim, generator=generator),
            torch.randn(1, kv_heads, capacity, head_dim, generator=generator),
            torch.randn(1, kv_heads, capacity, head_dim, generator=generator))


@pytest.mark.parametrize("family, layer, tokens", [("llama", 0, 3), ("gemma3", 0, 1)])
def test_prefill_and_sliding_window_steps_keep_sdpa(family, layer, tokens):
    attention = hf.tiny(family).model.layers[layer].self_attn
    query, key, value = _qkv(tokens)
    mask = torch.ones(1, 1, tokens, key.shape[2], dtype=torch.bool).tril(key.shape[2] - tokens)
    got, _ = splitk_decode_attention(attention, query, key, value, mask, scaling=0.25,
                                     position_ids=torch.arange(tokens)[None])
    want, _ = sdpa_attention_forward(attention, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_decode_step_without_positions_is_refused_by_name():
    attention = hf.tiny("llama").model.layers[0].self_attn
    with pytest.raises(DecodeAttentionError, match="LlamaAttention: .* needs the step's position_ids"):
        splitk_decode_attention(attention, *_qkv(1), None)


def test_a_decode_step_of_several_sequences_is_refused_by_name():
    attention = hf.tiny("llama").model.layers[0].self_attn
    query, key, value = (torch.cat([tensor, tensor]) for tensor in _qkv(1))
    with pytest.raises(DecodeAttentionError, match="LlamaAttention: .* takes one sequence, not 2: the attention mask"):
        splitk_decode_attention(attention, query, key, value, None, position_ids=torch.tensor([[5], [3]]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_machine_without_cuda_is_refused_when_the_model_is_switched():
    model = hf.tiny("llama").to(torch.bfloat16)
    with pytest.raises(DecodeAttentionError, match="no CUDA device"):
        use_splitk_decode(model)
    assert model.config._attn_implementation != "zerokv_splitk_decode"


@pytest.mark.parametrize("dtype, head_dim, named", [
    (torch.float32, 16, "the model is torch.float32; the kernels take torch.bfloat16 or torch.float16"),
    (torch.bfloat16, 24, "head size 24 is not a power of two of 16 or more"),
    (torch.bfloat16, 8, "head size 8 is not a power of two of 16 or more"),
])
def test_a_model_the_kernel_cannot_take_is_refused_by_name(dtype, head_dim, named):
    model = hf.tiny("llama")
    model.config.head_dim = head_dim
    with pytest.raises(DecodeAttentionError, match=f"llama: split-K decode attention: .*{named}"):
        use_splitk_decode(model.to(dtype))
