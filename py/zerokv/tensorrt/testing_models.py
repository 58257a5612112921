"""Tiny Llama- and Gemma-style decoders with a static KV cache, for the tests.

The cache write is pluggable so that one model covers every write form the
lowering must handle (index_copy with an arange and an offset, a constant index,
slice assignment, scattered and strided writes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, HEAD_DIM, MAX_SEQ, VOCAB, FFN = 32, 2, 16, 32, 64, 64

# (cache, positions or None, update [B, N, T, H], offset) -> None; writes in place.
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], None]


def hf_index_copy(cache, positions, update, offset):
    """Hugging Face's static cache: index_copy_ along the sequence axis."""
    cache.index_copy_(2, positions, update)


def slice_assignment(cache, positions, update, offset):
    """`cache[:, :, start:start + n] = update` with a static start."""
    cache[:, :, offset : offset + update.shape[2]] = update


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, gemma_style: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.1 + (0.0 if gemma_style else 1.0))
        self.eps = eps
        self.gemma_style = gemma_style

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # Gemma scales by (1 + weight).
        return normed * (1.0 + self.weight) if self.gemma_style else self.weight * normed


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, write: CacheWrite, gemma_style: bool, batch: int = 1):
        super().__init__()
        self.write = write
        self.gemma_style = gemma_style
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=True)
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)
        self.input_norm = RMSNorm(HIDDEN, gemma_style=gemma_style)
        self.post_norm = RMSNorm(HIDDEN, gemma_style=gemma_style)
        self.register_buffer("k_cache", torch.zeros(batch, HEADS, MAX_SEQ, HEAD_DIM))
        self.register_buffer("v_cache", torch.zeros(batch, HEADS, MAX_SEQ, HEAD_DIM))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, positions, offset, mask):
        batch, length, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(batch, length, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(h).view(batch, length, HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(h).view(batch, length, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
        angles = positions[:, None].float() * self.inv_freq[None, :]
        table = torch.cat((angles, angles), dim=-1)
        cos, sin = table.cos().unsqueeze(0), table.sin().unsqueeze(0)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.write(self.k_cache, positions, k, offset)
        self.write(self.v_cache, positions, v, offset)
        attention = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        x = x + self.o_proj(attention.transpose(1, 2).reshape(batch, length, HEADS * HEAD_DIM))
        h = self.post_norm(x)
        activation = F.gelu(self.gate_proj(h), approximate="tanh") if self.gemma_style else F.silu(
            self.gate_proj(h)
        )
        return x + self.down_proj(activation * self.up_proj(h))


class TinyDecoder(nn.Module):
    """embedding -> one decoder layer -> LM head, with a static [B, N, MAX_SEQ, H] cache.

    `positions(length, offset)` builds the written positions from the query length
    and the `offset` input, the way the model under test spells them.
    """

    def __init__(
        self,
        positions: Callable[[int, object], torch.Tensor],
        write: CacheWrite = hf_index_copy,
        gemma_style: bool = False,
        batch: int = 1,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.positions = positions
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layer = DecoderLayer(write, gemma_style, batch)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, offset):
        length = input_ids.shape[1]
        positions = self.positions(length, offset)
        # Attend only to written positions: key j is visible to query i if j <= position i.
        keys = torch.arange(MAX_SEQ)
        mask = keys[None, :] <= positions[:, None]
        x = self.embed(input_ids)
        return self.lm_head(self.layer(x, positions, offset, mask))


def arange_plus_offset(length, offset):
    return torch.arange(length) + offset


def offset_plus_arange(length, offset):
    return offset + torch.arange(length)


def export_decoder(
    model: TinyDecoder,
    length: int,
    offset,
    dynamic_length: bool = False,
    max_length: int = 16,
    batch: int = 1,
) -> torch.export.ExportedProgram:
    input_ids = torch.randint(0, VOCAB, (batch, length))
    dynamic_shapes = None
    if dynamic_length:
        dynamic_shapes = ({1: torch.export.Dim("query_length", min=1, max=max_length)}, None)
    with torch.no_grad():
        return torch.export.export(model.eval(), (input_ids, offset), dynamic_shapes=dynamic_shapes)
