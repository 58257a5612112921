"""zerokv::llama_decode_step computes transformers' Llama decode step, and LlamaDecodeStep refuses,
naming why, the models it does not compute."""

import pytest
import torch
import transformers

from zerokv.megakernel.llama_step import LlamaDecodeStep, LlamaStepError, model_weights, unsupported_model
from zerokv.megakernel.testing import SMALL, small_model



def _caches(model, capacity):
    config = model.config
    return [torch.zeros(1, config.num_key_value_heads, capacity, config.head_dim, dtype=model.dtype)
            for _ in range(2 * config.num_hidden_layers)]


def _step(model, caches, token, position):
    weights = [tensor for _, tensor in model_weights(model)]
    return torch.ops.zerokv.llama_decode_step(torch.tensor([[token]]), torch.tensor([position]), caches, weights,
                                              model.config.rms_norm_eps,
                                              model.model.rotary_emb.attention_scaling)


def test_the_op_is_transformers_decode_step_in_float32():
    model = small_model(torch.float32)
    prompt = torch.tensor([[5, 17, 301, 42, 9]])
    with torch.no_grad():
        history = model(prompt, use_cache=True).past_key_values
        caches = _caches(model, 16)
        for layer, cached in enumerate(history.layers):
            caches[2 * layer][:, :, :prompt.shape[1]] = cached.keys
            caches[2 * layer + 1][:, :, :prompt.shape[1]] = cached.values
        theirs = model(torch.tensor([[77]]), past_key_values=history, use_cache=True).logits
        logits, rows = _step(model, caches, 77, prompt.shape[1])
    torch.testing.assert_close(logits, theirs, atol=2e-5, rtol=1e-4)
    for layer, cached in enumerate(history.layers):
        torch.testing.assert_close(rows[2 * layer], cached.keys[:, :, -1:], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(rows[2 * layer + 1], cached.values[:, :, -1:], atol=2e-5, rtol=1e-4)


def test_the_step_decodes_as_transformers_in_bf16():
    model = small_model()
    step = LlamaDecodeStep(model)
    caches = _caches(model, 32)
    history = transformers.DynamicCache(config=model.config)
    token = 11
    with torch.no_grad():
        for position in range(8):
            ours = step(torch.tensor([[token]]), torch.tensor([position]), *caches)
            theirs = model(torch.tensor([[token]]), past_key_values=history, use_cache=True).logits
            cosine = torch.nn.functional.cosine_similarity(ours.float().flatten(), theirs.float().flatten(), dim=0)
            assert cosine > 0.9995, (position, cosine)
            token = int(theirs.argmax())
    # Each step wrote its row and nothing past it.
    assert caches[0][:, :, :8].abs().sum(-1).all()
    assert not caches[0][:, :, 8:].any()


@pytest.mark.parametrize("changes, reason", [
    (dict(head_dim=128), "head_dim is 128, not 64"),
    (dict(num_attention_heads=4), "4 query heads for 2 KV heads"),
    (dict(attention_bias=True), "biases"),
    (dict(hidden_act="gelu"), "hidden_act is 'gelu'"),
    (dict(intermediate_size=1000), "intermediate_size is 1000, not a multiple of 512"),
    (dict(intermediate_size=8704), "intermediate_size is 8704, wider than 8192"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
])
def test_refuses_a_llama_the_kernel_cannot_run_saying_why(changes, reason):
    with pytest.raises(LlamaStepError, match="model: .*" + reason.replace("(", r"\(")):
        LlamaDecodeStep(small_model(**changes))


def test_refuses_other_models_and_dtypes():
    assert "not transformers' LlamaForCausalLM" in unsupported_model(transformers.MistralForCausalLM(
        transformers.MistralConfig(**SMALL)).to(torch.bfloat16))
    assert "dtype is torch.float32" in unsupported_model(small_model(torch.float32))


def test_refuses_a_position_outside_the_caches():
    model = small_model()
    with pytest.raises(LlamaStepError, match="cache_position 16 is outside the caches' 16 positions"):
        _step(model, _caches(model, 16), 3, 16)


def test_refuses_a_token_outside_the_vocabulary():
    model = small_model()
    with pytest.raises(LlamaStepError, match="input_ids 1000 is outside the vocabulary of 1000 tokens"):
        _step(model, _caches(model, 16), 1000, 3)
