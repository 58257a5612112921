"""The decoder //tools/bench:decode_roofline measures, and the bytes a decode step must read.

llama-3.2-1b: the Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads with 8 KV heads, head dim 64,
FFN 8192, vocab 128256, tied embeddings) with random weights, bfloat16. tiny: the same family small
enough for the CPU tests of the bench's own code.
"""

from __future__ import annotations

import torch

SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True),
}
SEED = 0


def build(shape: str, device: str = "cpu", dtype=torch.bfloat16):
    """The model of `shape`, the same weights in every process: initialized on `device` from SEED
    (on the GPU machine, initialize on "cuda" and move it: much faster than the CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape])
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def weight_bytes(model) -> int:
    """Every parameter once (tied embeddings are one tensor): a decode step reads all of them."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_position(model) -> int:
    """K and V of every layer at one position: what attention reads per committed position."""
    config = model.config
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * model.dtype.itemsize
