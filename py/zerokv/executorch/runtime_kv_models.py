"""A decoder step over caches passed in as inputs, for runtime-owned KV tests and examples.

`CacheInputDecoder.forward(tokens, position, k_cache, v_cache)` writes this step's keys and values
at positions [position, position + tokens) of the caches (in place) and attends over every cache
position up to its own, so its result does not depend on the caches' capacity (dim 2) beyond that.
`FreshPrefill` writes the caches without reading them, as a Hugging Face prefill does;
`MixedCacheDecoder` also writes caches of its own (buffers).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, HEAD_DIM = 64, 32, 2, 16


class CacheInputDecoder(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator))
        self.qkv = nn.Parameter(torch.randn(HIDDEN, 3 * HEADS * HEAD_DIM, generator=generator) / HIDDEN**0.5)
        self.lm_head = nn.Parameter(torch.randn(HEADS * HEAD_DIM, VOCAB, generator=generator) / HIDDEN**0.5)

    def write_step(self, tokens, position, k_cache, v_cache):
        """Projects the step's tokens and writes their keys and values into the caches at
        [position, position + tokens): (q, k, v, positions)."""
        steps = tokens.shape[1]
        x = self.embed[tokens]
        q, k, v = (x @ self.qkv).view(1, steps, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        positions = torch.arange(steps) + position
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        return q, k, v, positions

    def logits(self, attention):
        return attention.transpose(1, 2).reshape(1, attention.shape[2], HEADS * HEAD_DIM) @ self.lm_head

    def forward(self, tokens, position, k_cache, v_cache):
        q, _, _, positions = self.write_step(tokens, position, k_cache, v_cache)
        mask = torch.arange(k_cache.shape[2])[None, :] <= positions[:, None]
        return self.logits(F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask))


class FreshPrefill(CacheInputDecoder):
    """A prefill as Hugging Face decoders run one: it attends over its own fresh K/V (causal) and
    writes the caches for the decode steps, without reading them back. From position 0 its result
    equals CacheInputDecoder's over the same tokens."""

    def forward(self, tokens, position, k_cache, v_cache):
        q, k, v, _ = self.write_step(tokens, position, k_cache, v_cache)
        return self.logits(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class MixedCacheDecoder(CacheInputDecoder):
    """CacheInputDecoder plus a second attention over caches it owns as buffers (caller-owned, of
    BUFFER_CAPACITY positions), written at the same positions: one step writes runtime-owned and
    caller-owned caches, so one delegate holds both kinds."""

    BUFFER_CAPACITY = 16

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.register_buffer("k_buffer", torch.zeros(1, HEADS, self.BUFFER_CAPACITY, HEAD_DIM))
        self.register_buffer("v_buffer", torch.zeros(1, HEADS, self.BUFFER_CAPACITY, HEAD_DIM))

    def forward(self, tokens, position, k_cache, v_cache):
        logits = super().forward(tokens, position, k_cache, v_cache)
        steps = tokens.shape[1]
        positions = torch.arange(steps) + position
        q = logits[..., : HEADS * HEAD_DIM].view(1, steps, HEADS, HEAD_DIM).transpose(1, 2)
        self.k_buffer.index_copy_(2, positions, q)
        self.v_buffer.index_copy_(2, positions, q * 2)
        mask = torch.arange(self.BUFFER_CAPACITY)[None, :] <= positions[:, None]
        attention = F.scaled_dot_product_attention(q, self.k_buffer, self.v_buffer, attn_mask=mask)
        return logits + attention.transpose(1, 2).reshape(1, steps, HEADS * HEAD_DIM).sum(-1, keepdim=True)


def empty_caches(capacity: int):
    return tuple(torch.zeros(1, HEADS, capacity, HEAD_DIM) for _ in range(2))


def export_step(model: CacheInputDecoder, steps: int, max_capacity: int):
    """The step for `steps` tokens, with a dynamic cache capacity up to max_capacity."""
    capacity = torch.export.Dim("capacity", min=2, max=max_capacity)
    k_cache, v_cache = empty_caches(max_capacity)
    tokens = torch.zeros(1, steps, dtype=torch.long)
    with torch.no_grad():
        return torch.export.export(
            model.eval(),
            (tokens, torch.tensor(0), k_cache, v_cache),
            dynamic_shapes=(None, None, {2: capacity}, {2: capacity}),
        )
