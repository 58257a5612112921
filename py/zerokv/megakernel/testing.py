"""The small transformers Llama model the megakernel's tests export and decode: the kernel's shapes
(head size 64, four query heads per KV head, widths of 512), two layers, random weights."""

from __future__ import annotations

import torch

SMALL = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True)


def small_model(dtype=torch.bfloat16, **changes):
    """transformers' LlamaForCausalLM of SMALL with `changes`, the same weights at every call."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(SMALL, **changes))).to(dtype).eval()
