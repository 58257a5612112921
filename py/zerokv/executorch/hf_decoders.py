"""Hugging Face decoders exported for zerokv. Nothing is downloaded: configs are built here, or a
checkpoint is read from a local directory.

Two forms:
  - transformers' own ExecuTorch integration (export_decode / export_prefill): a static cache held in
    per-layer K/V buffers written with index_copy_, a rotary inv_freq and per-layer cumulative_length
    buffers. One method only: ExecuTorch gives each method its own copy of a buffer.
  - CacheInputs (export_programs): the same model with its caches as method inputs, so that a prefill
    and a decode method share runtime-owned caches (runtime_kv_for). The attention, masks and rotary
    embeddings are transformers' own: only the cache layer differs, writing the step's K/V at the
    positions the runtime supplies (the `cache_position` input) into a cache whose positions axis
    is dynamic (the runtime grows it).
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

import zerokv.executorch as zx

MAX_CACHE_LEN = 32
FAMILIES = ("llama", "qwen3", "gemma3")


def tiny_llama(seed: int = 0):
    """A 2-layer Llama with grouped-query attention (4 query heads, 2 KV heads), static cache."""
    model = tiny("llama", seed)
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": MAX_CACHE_LEN}
    return model


def tiny(family: str, seed: int = 0, max_positions: int = 256, sliding_window: int = 4):
    """A small random-weight decoder of `family`: Llama-3 (grouped-query attention), Qwen3 (q/k
    norms, grouped-query attention) or Gemma-3 (sliding-window and global layers)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions)
    if family == "llama":
        model_class, config = LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **common)
    elif family == "qwen3":
        model_class, config = Qwen3ForCausalLM, Qwen3Config(num_hidden_layers=2, **common)
    elif family == "gemma3":
        # Layers 0-2 slide over `sliding_window` positions, layer 3 is global: decoding past the
        # window tells a sliding mask from a causal one.
        model_class = Gemma3ForCausalLM
        config = Gemma3TextConfig(num_hidden_layers=4, sliding_window=sliding_window, sliding_window_pattern=4,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"], **common)
    else:
        raise zx.ZeroKVError(f"family {family!r}: expected one of {FAMILIES}")
    torch.manual_seed(seed)
    return model_class(config).eval()


def load_checkpoint(directory: str):
    """A local Hugging Face checkpoint directory (config.json + safetensors), never a hub name."""
    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()


def _refuse_rolling_sliding_layers(model, max_cache_len: int):
    """transformers' static sliding-window layer rolls its cache over in Python branches that the
    trace takes for an empty cache: past the window its program writes beyond the layer's cache."""
    window = getattr(model.config, "sliding_window", None)
    rolling = [index for index, sliding in enumerate(sliding_layers(model.config))
               if sliding and window < max_cache_len]
    if rolling:
        raise zx.ZeroKVError(
            f"{model.config.model_type} layers {rolling}: transformers' static sliding-window cache ({window} "
            f"positions, < max_cache_len {max_cache_len}) cannot be exported: its roll-over is not in the "
            "traced program. Export with CacheInputs (export_programs), whose sliding layers keep every "
            "position and apply the window in their mask")


def export_decode(model):
    """transformers' integration: the one-token decode step (input_ids [1, 1], cache_position [1])."""
    _refuse_rolling_sliding_layers(model, MAX_CACHE_LEN)
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        return exportable.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))


def export_prefill(model, max_tokens: int = MAX_CACHE_LEN // 2):
    """transformers' integration: the prefill, T dynamic in [2, max_tokens]."""
    _refuse_rolling_sliding_layers(model, MAX_CACHE_LEN)
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    tokens = torch.export.Dim("tokens", min=2, max=max_tokens)
    with torch.no_grad():
        return exportable.export(input_ids=torch.ones(1, 4, dtype=torch.long), cache_position=torch.arange(4),
                                 dynamic_shapes={"input_ids": {1: tokens}, "cache_position": {0: tokens}})


class _InputCacheLayer(CacheLayerMixin):
    """One layer's K and V, method inputs [1, kv_heads, capacity, head_dim], written at `positions`."""

    is_compileable = True

    def __init__(self, keys, values, positions, sliding: bool):
        super().__init__()
        self.keys, self.values, self.positions = keys, values, positions
        self.is_sliding = sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        raise AssertionError("the caches are the method's inputs, never allocated by transformers")

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.positions, key_states)
        self.values.index_copy_(2, self.positions, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length):
        # The whole cache, masked by position: a sliding layer's window is in its mask, not its size.
        return self.keys.shape[2], 0

    def get_seq_length(self):
        return self.positions[0]

    def get_max_length(self):
        return self.keys.shape[2]


class CacheInputs(torch.nn.Module):
    """forward(input_ids [1, T], cache_position [T], k_0, v_0, k_1, v_1, ...) -> logits [1, T, vocab].

    The caches are written in place at cache_position (the runtime's positions when they are
    runtime-owned). Sliding-window layers keep every position in a flat cache; their window is
    applied by transformers' sliding mask, so they attend exactly as in eager.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.sliding = sliding_layers(model.config)

    def forward(self, input_ids, cache_position, *caches):
        # The runtime fills cache_position with consecutive positions; writing at the first plus an
        # arange says so to the engines (TensorRT writes in place only where it can prove it).
        positions = torch.arange(input_ids.shape[1]) + cache_position[0]
        layers = [_InputCacheLayer(caches[2 * index], caches[2 * index + 1], positions, sliding)
                  for index, sliding in enumerate(self.sliding)]
        out = self.model(input_ids=input_ids, position_ids=cache_position.unsqueeze(0),
                         past_key_values=Cache(layers=layers), use_cache=True)
        return out.logits


def sliding_layers(config):
    """Per layer: whether it attends over a sliding window."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [kind == "sliding_attention" for kind in types]


def cache_shape(config, capacity: int):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (1, config.num_key_value_heads, capacity, head_dim)


def cache_input_names(config):
    """The placeholders torch.export gives CacheInputs' `*caches`: K then V of each layer."""
    return [f"caches_{index}" for index in range(2 * config.num_hidden_layers)]


def export_step(model, tokens, max_capacity: int, max_tokens: int):
    """CacheInputs over `tokens` tokens (1: static; more: dynamic in [2, max_tokens]) with a dynamic
    cache capacity up to max_capacity."""
    wrapper = CacheInputs(model).eval()
    caches = tuple(torch.zeros(cache_shape(model.config, max_capacity), dtype=model.dtype)
                   for _ in range(2 * model.config.num_hidden_layers))
    capacity = torch.export.Dim("capacity", min=2, max=max_capacity)
    width = torch.export.Dim("tokens", min=2, max=max_tokens) if tokens > 1 else None
    with torch.no_grad():
        return torch.export.export(
            wrapper, (torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens), *caches),
            dynamic_shapes=({1: width} if width else None, {0: width} if width else None,
                            tuple({2: capacity} for _ in caches)))


def export_programs(model, max_capacity: int, max_prefill: int):
    """{"prefill": (T dynamic in [2, max_prefill]), "decode": (1 token)} over cache inputs."""
    return {"prefill": export_step(model, 4, max_capacity, max_prefill),
            "decode": export_step(model, 1, max_capacity, 1)}


def runtime_kv_for(config, max_capacity: int, initial_capacity: int) -> zx.RuntimeKV:
    """Every layer's caches runtime-owned and flat (sliding layers too: see CacheInputs)."""
    names = cache_input_names(config)
    layers = tuple(zx.KVCacheLayer(names[2 * index], names[2 * index + 1], max_capacity=max_capacity,
                                   initial_capacity=initial_capacity)
                   for index in range(config.num_hidden_layers))
    return zx.RuntimeKV(layers=layers, step_width=("input_ids", 1), positions="cache_position")


def constant_methods(model, max_seq_len: int):
    """The metadata methods ExecuTorch's LLM runners read, as transformers' integration and
    optimum-executorch name them."""
    config, generation = model.config, model.generation_config
    eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
    methods = {
        "get_max_seq_len": max_seq_len,
        "get_max_batch_size": 1,
        "get_vocab_size": config.vocab_size,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,
    }
    bos = generation.bos_token_id if generation.bos_token_id is not None else config.bos_token_id
    if bos is not None:
        methods["get_bos_id"] = bos
    if eos is not None:
        methods["get_eos_ids"] = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return methods


def eager_steps(model, prompt, steps: int):
    """HF eager greedy decoding (its default dynamic cache): every step's logits [1, vocab] (the
    prompt's last one first) and the tokens chosen."""
    logits, tokens = [], []
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        cache = out.past_key_values
        for _ in range(steps + 1):
            last = out.logits[:, -1]
            logits.append(last)
            token = last.argmax(-1, keepdim=True)
            tokens.append(int(token))
            if len(logits) == steps + 1:
                break
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
    return logits, tokens
