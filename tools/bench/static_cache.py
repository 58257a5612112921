"""A transformers StaticCache of a model, allocated, and placed at a position: what the benches and
the megakernel's checks decode over."""

from __future__ import annotations

import torch


def allocated(model, length):
    """A StaticCache of `length` positions for `model`, its layers allocated (lazily, at the first
    write: one step at position 0) in the model's dtype and on its device."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    with torch.no_grad():
        model(input_ids=torch.tensor([[0]]).to(model.device), past_key_values=cache, use_cache=True)
    return cache


def place(cache, position):
    """Puts every layer of a transformers StaticCache at `position` (it writes where its layers'
    cumulative_length says, not where the caller's positions say)."""
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length"):
            raise SystemExit(f"this transformers' {type(layer).__name__} has no cumulative_length: a cache "
                             "cannot be placed at a position")
        layer.cumulative_length.fill_(position)
