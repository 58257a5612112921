"""Hugging Face decoders exported for zerokv. Nothing is downloaded: configs are built here, or a
checkpoint is read from a local directory.

Two forms:
  - transformers' own ExecuTorch integration (export_decode / export_prefill): a static cache held in
    per-layer K/V buffers written with index_copy_, a rotary inv_freq and per-layer cumulative_length
    buffers. One method only: ExecuTorch gives each method its own copy of a buffer.
  - CacheInputs (export_programs): the same model with its caches as method inputs, so that a prefill
    and a decode method share runtime-owned caches (the RuntimeKV export_programs returns). The attention and rotary
    embeddings are transformers' own, and so are the mask functions' formats (its mask interface):
    only the cache layer differs, writing the step's K/V where the runtime says, and the masks,
    built here from the runtime's positions. Global layers keep every position in a flat cache the
    runtime grows (written at the `cache_position` input); sliding-window layers keep the last
    positions in a ring the runtime never grows (written at the `ring_slots` input).
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
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

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
            "traced program. Export with CacheInputs (export_programs), whose sliding layers are "
            "runtime-owned ring caches")


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
    """One layer's K and V, method inputs [1, kv_heads, capacity or ring slots, head_dim], written
    along dim 2 at `index` (a flat layer's step positions, a ring layer's slots)."""

    is_compileable = True

    def __init__(self, keys, values, positions, index, sliding: bool):
        super().__init__()
        self.keys, self.values, self.positions, self.index = keys, values, positions, index
        self.is_sliding = sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        raise AssertionError("the caches are the method's inputs, never allocated by transformers")

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.index, key_states)
        self.values.index_copy_(2, self.index, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length):
        # The whole cache: a ring's slots or a flat cache's capacity (CacheInputs masks it by position).
        return self.keys.shape[2], 0

    def get_seq_length(self):
        return self.positions[0]

    def get_max_length(self):
        return self.keys.shape[2]


def _ring_mask_function(last, slots: int, window: int):
    """Over a ring of `slots` slots after a step whose last position is `last`: slot s holds position
    last - ((last - s) mod slots), none yet while that is negative. Keys carry their rotary embedding
    from before they were cached, so their order in the ring does not matter: a query at q attends
    the slots holding positions in (q - window, q], transformers' sliding window."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        held = last - torch.remainder(last - kv_idx, slots)
        return (held >= 0) & (held > q_idx - window) & (held <= q_idx)

    return inner


class CacheInputs(torch.nn.Module):
    """forward(input_ids [1, T], cache_position [T], k_0, v_0, k_1, v_1, ..., ring_slots=[T]) -> logits
    [1, T, vocab]; ring_slots only when the model has sliding-window layers.

    The caches are written in place: a global layer's flat cache at cache_position, a sliding
    layer's ring at ring_slots (the runtime's positions and slots when they are runtime-owned). The
    masks are built here, as transformers' mask interface formats them for the attention
    implementation: causal over a flat cache, the window over what a ring holds.
    """

    def __init__(self, model):
        super().__init__()
        config = model.config
        self.model = model
        self.sliding = sliding_layers(config)
        unknown = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
        if unknown:
            raise zx.ZeroKVError(f"{config.model_type}: layer types {unknown} have no mask here (only "
                                 "full_attention, causal, and sliding_attention, a ring's window)")
        if any(self.sliding):
            if config._attn_implementation not in ("sdpa", "eager"):
                raise zx.ZeroKVError(
                    f"{config.model_type}: attention implementation {config._attn_implementation!r} takes no "
                    "4-D mask, and the ring caches of its sliding layers need one: load it with "
                    "attn_implementation='sdpa' or 'eager'")
            if getattr(config, "use_bidirectional_attention", False):
                raise zx.ZeroKVError(f"{config.model_type}: bidirectional sliding attention reads positions after "
                                     "the query, which a ring cache written step by step does not hold yet")

    def forward(self, input_ids, cache_position, *caches, ring_slots=None):
        # The runtime fills cache_position with consecutive positions; writing at the first plus an
        # arange says so to the engines (TensorRT writes in place only where it can prove it).
        positions = torch.arange(input_ids.shape[1], device=cache_position.device) + cache_position[0]
        layers = [_InputCacheLayer(caches[2 * index], caches[2 * index + 1], positions,
                                   ring_slots if sliding else positions, sliding)
                  for index, sliding in enumerate(self.sliding)]
        # A one-token step's position is cache_position itself. Passed as the input, not as the
        # arange, it reaches each layer's attention kernel as a view: Inductor would otherwise compute
        # the arange again into a buffer of its own for every layer's kernel, a launch each.
        position_ids = (cache_position if input_ids.shape[1] == 1 else positions).unsqueeze(0)
        out = self.model(input_ids=input_ids, position_ids=position_ids,
                         attention_mask=self._masks(positions, layers), past_key_values=Cache(layers=layers),
                         use_cache=True)
        return out.logits

    def _masks(self, positions, layers):
        """Causal over a global layer's flat cache; with sliding layers, a mapping by layer type (as
        transformers' hybrid models take it) that adds the window over a ring's slots."""
        config = self.model.config
        interface = ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]
        masks = {}
        for layer in layers:
            kind = "sliding_attention" if layer.is_sliding else "full_attention"
            if kind in masks:
                continue
            slots = layer.keys.shape[2]
            mask_function = (_ring_mask_function(positions[-1], slots, config.sliding_window) if layer.is_sliding
                             else causal_mask_function)
            masks[kind] = interface(batch_size=1, q_length=positions.shape[0], kv_length=slots,
                                    q_offset=positions[0], kv_offset=0, mask_function=mask_function,
                                    allow_is_causal_skip=False, dtype=self.model.dtype, config=config,
                                    device=positions.device)
        return masks if any(self.sliding) else masks["full_attention"]


def sliding_layers(config):
    """Per layer: whether it attends over a sliding window."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [kind == "sliding_attention" for kind in types]


def ring_slots(config, max_capacity: int, max_prefill: int) -> int:
    """The slots of a sliding layer's ring cache. A step of T tokens writes its positions p0..p0+T-1
    before it attends, and its query at p needs the keys at (p - W, p] (W the sliding window): a ring
    of W + T - 1 slots or more overwrites none of them, and the widest step is the prefill's. With a
    global layer, no position reaches its max_capacity (the runtime refuses the step), so a ring of
    max_capacity slots never wraps: exact for any window. 0 without sliding layers."""
    layers = [index for index, sliding in enumerate(sliding_layers(config)) if sliding]
    if not layers:
        return 0
    slots = config.sliding_window + max_prefill - 1
    if slots <= max_capacity:
        return slots
    if len(layers) < config.num_hidden_layers:
        return max_capacity
    raise zx.ZeroKVError(
        f"{config.model_type} sliding layers {layers}: a ring for window {config.sliding_window} and prefills of "
        f"{max_prefill} tokens needs {slots} slots, more than max_capacity {max_capacity}, and no global layer "
        "bounds the positions: raise max_capacity or lower max_prefill")


def cache_shape(config, capacity: int):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (1, config.num_key_value_heads, capacity, head_dim)


def cache_input_names(config):
    """The placeholders torch.export gives CacheInputs' `*caches`: K then V of each layer."""
    return [f"caches_{index}" for index in range(2 * config.num_hidden_layers)]


RING_SLOTS_INPUT = "ring_slots"  # CacheInputs' slots input, which the runtime fills for its rings


def step_inputs(config, input_ids):
    """A step's method inputs: input_ids, cache_position and, with sliding layers, ring_slots. The
    runtime fills the last two: their values only give the step's width."""
    width = torch.arange(input_ids.shape[1])
    return [input_ids, width] + ([width] if any(sliding_layers(config)) else [])


def export_step(model, tokens, max_capacity: int, max_tokens: int, slots: int):
    """CacheInputs over `tokens` tokens (1: static; more: dynamic in [2, max_tokens]) with a dynamic
    flat capacity up to max_capacity and, for sliding layers, rings of `slots` slots (dynamic too:
    the runtime binds its own storage)."""
    config = model.config
    sliding = sliding_layers(config)
    wrapper = CacheInputs(model).eval()
    extents = [slots if ring else max_capacity for ring in sliding for _ in "kv"]
    # On the model's device: a program exported from a CUDA model runs there as a module.
    device = model.device
    caches = tuple(torch.zeros(cache_shape(config, extent), dtype=model.dtype, device=device) for extent in extents)
    capacity = torch.export.Dim("capacity", min=2, max=max_capacity)
    ring = torch.export.Dim("ring", min=2, max=slots) if any(sliding) else None
    width = torch.export.Dim("tokens", min=2, max=max_tokens) if tokens > 1 else None
    kwargs, dynamic_kwargs = {}, {}
    if any(sliding):
        kwargs[RING_SLOTS_INPUT] = torch.arange(tokens, device=device)
        dynamic_kwargs[RING_SLOTS_INPUT] = {0: width} if width else None
    with torch.no_grad():
        return torch.export.export(
            wrapper, (torch.zeros(1, tokens, dtype=torch.long, device=device), torch.arange(tokens, device=device),
                      *caches), kwargs=kwargs,
            dynamic_shapes={"input_ids": {1: width} if width else None,
                            "cache_position": {0: width} if width else None,
                            "caches": tuple({2: ring if is_ring else capacity}
                                            for is_ring in sliding for _ in "kv"),
                            **dynamic_kwargs})


def export_programs(model, max_capacity: int, max_prefill: int, initial_capacity: int, prefill: bool = True):
    """({"prefill": (T dynamic in [2, max_prefill]), "decode": (1 token)} over cache inputs, the
    RuntimeKV of their caches). One ring size for both: a ring sized for narrower prefills than the
    program takes would silently drop keys its queries need. prefill=False: the decode method alone
    (max_prefill 1 then: every step is one token)."""
    slots = ring_slots(model.config, max_capacity, max_prefill)
    programs = {"prefill": export_step(model, 4, max_capacity, max_prefill, slots)} if prefill else {}
    programs["decode"] = export_step(model, 1, max_capacity, 1, slots)
    return programs, _runtime_kv(model.config, max_capacity, initial_capacity, slots)


def _runtime_kv(config, max_capacity: int, initial_capacity: int, slots: int) -> zx.RuntimeKV:
    """Every layer's caches runtime-owned: a global layer's flat, a sliding layer's a ring of `slots`."""
    names = cache_input_names(config)

    def layer(index, sliding):
        k_input, v_input = names[2 * index], names[2 * index + 1]
        if sliding:
            return zx.KVCacheLayer(k_input, v_input, max_capacity=slots, initial_capacity=slots, policy="ring",
                                   window=slots, slots=RING_SLOTS_INPUT)
        return zx.KVCacheLayer(k_input, v_input, max_capacity=max_capacity, initial_capacity=initial_capacity)

    layers = tuple(layer(index, sliding) for index, sliding in enumerate(sliding_layers(config)))
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
