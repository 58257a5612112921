"""The binding's refusals of a model or caches the step cannot take, each naming what is at fault (no
GPU needed: they come before any device work)."""

import os

import pytest
import torch
import transformers

from cc.engines.megakernel import llama_decode_step as megakernel

SMALL = dict(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def library():
    return megakernel.load(os.environ["ZEROKV_MEGAKERNEL_LIBRARY"])


def _model(**changes):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(SMALL, **changes))).to(torch.bfloat16)


def _caches(model, capacity=64, layers=None):
    config = model.config
    shape = (config.num_key_value_heads, capacity, config.head_dim)
    count = config.num_hidden_layers if layers is None else layers
    return ([torch.zeros(shape, dtype=torch.bfloat16) for _ in range(count)],
            [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(count)])


def test_refuses_a_rotary_embedding_that_changes_with_the_sequence(library):
    model = _model(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(ValueError, match="rope type 'dynamic': its frequencies change with the sequence"):
        megakernel.LlamaDecodeStep(library, model, *_caches(model))


def test_refuses_projections_with_a_bias(library):
    model = _model(attention_bias=True)
    with pytest.raises(ValueError, match="model: its projections have biases; the step has none"):
        megakernel.LlamaDecodeStep(library, model, *_caches(model))


def test_refuses_caches_that_are_not_one_per_layer_of_the_models_shape(library):
    model = _model()
    with pytest.raises(ValueError, match="1 key and 1 value caches for 2 layers"):
        megakernel.LlamaDecodeStep(library, model, *_caches(model, layers=1))
    keys, values = _caches(model)
    values[1] = torch.zeros(2, 64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"values\[1\] is \(2, 64, 32\), not \(2, 64, 64\)"):
        megakernel.LlamaDecodeStep(library, model, keys, values)


def test_refuses_a_shape_the_kernel_cannot_run_saying_why(library):
    model = _model(intermediate_size=1000)
    with pytest.raises(ValueError, match=r"model: intermediate_size is 1000, not a multiple of 512"):
        megakernel.LlamaDecodeStep(library, model, *_caches(model))


def test_refuses_tensors_off_the_gpu(library):
    model = _model()
    with pytest.raises(ValueError, match="layers.0.input_norm: torch.bfloat16 on cpu, contiguous True; the step "
                                         "needs a contiguous torch.bfloat16 CUDA tensor"):
        megakernel.LlamaDecodeStep(library, model, *_caches(model))


def test_check_repeatable_refuses_what_would_compare_nothing_before_any_launch():
    keys, values = _caches(_model())
    # No step: a refusal must come before the step is touched.
    with pytest.raises(ValueError, match="1 launches at 1 positions compare nothing"):
        megakernel.check_repeatable(None, keys, values, positions=(5,), launches=1)
    with pytest.raises(ValueError, match="10 launches at 0 positions compare nothing"):
        megakernel.check_repeatable(None, keys, values, positions=(), launches=10)
    with pytest.raises(ValueError, match=r"positions \[64, -1\] are outside the caches' 64 positions"):
        megakernel.check_repeatable(None, keys, values, positions=(5, 64, -1), launches=10)
