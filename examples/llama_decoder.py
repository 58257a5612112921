"""A small Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU MLP) with random weights from a
fixed seed, in the two KV cache forms zerokv lowers:

- caller-owned (`LlamaDecoder(config, max_seq)`): each layer's K/V cache is a model buffer written
  with `index_copy_` (Hugging Face's static cache), `forward(tokens, position)`;
- runtime-owned (`LlamaDecoder(config)`): the caches are inputs `k_cache_<i>`, `v_cache_<i>` written
  in place, with a dynamic positions axis, `forward(tokens, position, k_cache_0, v_cache_0, ...)`.

Either way a step writes positions [position, position + tokens) and attends to every cache position
up to its own, so its result does not depend on the cache's capacity.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    head_dim: int = 32
    ffn: int = 256

    def cache_shape(self, capacity: int):
        return (1, self.heads, capacity, self.head_dim)

    def cache_bytes(self, capacity: int) -> int:
        """Bytes of every layer's K and V cache (float32) at `capacity` positions."""
        return 2 * self.layers * self.heads * capacity * self.head_dim * 4


TINY = Config(vocab=64, hidden=32, layers=2, heads=2, head_dim=16, ffn=64)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, generator: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim, generator=generator))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _linear(inputs: int, outputs: int, generator: torch.Generator) -> nn.Parameter:
    return nn.Parameter(torch.randn(inputs, outputs, generator=generator) / inputs**0.5)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    def __init__(self, config: Config, generator: torch.Generator):
        super().__init__()
        self.config = config
        width = config.heads * config.head_dim
        self.attention_norm = RMSNorm(config.hidden, generator)
        self.qkv = _linear(config.hidden, 3 * width, generator)
        self.out = _linear(width, config.hidden, generator)
        self.mlp_norm = RMSNorm(config.hidden, generator)
        self.gate = _linear(config.hidden, config.ffn, generator)
        self.up = _linear(config.hidden, config.ffn, generator)
        self.down = _linear(config.ffn, config.hidden, generator)

    def forward(self, x, positions, cos, sin, k_cache, v_cache):
        steps = x.shape[1]
        c = self.config
        q, k, v = (self.attention_norm(x) @ self.qkv).view(1, steps, 3, c.heads, c.head_dim).permute(2, 0, 3, 1, 4)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        visible = torch.arange(k_cache.shape[2], device=k_cache.device)[None, :] <= positions[:, None]
        attention = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible)
        x = x + attention.transpose(1, 2).reshape(1, steps, c.heads * c.head_dim) @ self.out
        h = self.mlp_norm(x)
        return x + (F.silu(h @ self.gate) * (h @ self.up)) @ self.down


class LlamaDecoder(nn.Module):
    """`max_seq` given: caller-owned caches (buffers of that capacity); None: runtime-owned (inputs)."""

    def __init__(self, config: Config, max_seq: int | None = None, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.config = config
        self.embed = nn.Parameter(torch.randn(config.vocab, config.hidden, generator=generator))
        self.layers = nn.ModuleList(Layer(config, generator) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, generator)
        self.lm_head = _linear(config.hidden, config.vocab, generator)
        inverse_frequencies = 1.0 / (10000 ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inverse_frequencies", inverse_frequencies, persistent=False)
        self.caller_owned = max_seq is not None
        if self.caller_owned:
            for index in range(config.layers):
                self.register_buffer(f"k_cache_{index}", torch.zeros(config.cache_shape(max_seq)))
                self.register_buffer(f"v_cache_{index}", torch.zeros(config.cache_shape(max_seq)))

    def forward(self, tokens, position, *caches):
        steps = tokens.shape[1]
        positions = torch.arange(steps, device=position.device) + position
        angles = positions[:, None].float() * self.inverse_frequencies[None, :]
        table = torch.cat((angles, angles), dim=-1)
        x = self.embed[tokens]
        # In the weights' dtype, so that a bfloat16 model writes bfloat16 caches.
        cos, sin = table.cos().to(x.dtype), table.sin().to(x.dtype)
        if self.caller_owned:
            caches = [getattr(self, f"{kind}_cache_{index}") for index in range(self.config.layers) for kind in "kv"]
        for index, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, caches[2 * index], caches[2 * index + 1])
        return self.norm(x) @ self.lm_head

    def reset_caches(self):
        for buffer in self.buffers():
            if buffer.dim() == 4:
                buffer.zero_()


def cache_input_names(config: Config):
    return [f"{kind}_cache_{index}" for index in range(config.layers) for kind in "kv"]
