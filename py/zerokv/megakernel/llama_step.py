"""The decode step of a transformers Llama model as one op: what the MEGAKERNEL engine runs.

    program, runtime_kv = zerokv.megakernel.export.export_decode(model, max_capacity)  # refuses, saying why
    manager = zerokv.executorch.export({"decode": program}, engine="megakernel", runtime_kv=runtime_kv)

`zerokv::llama_decode_step(input_ids, cache_position, caches, weights, rms_eps, rope_attention_scaling)`
returns the logits and this step's K and V rows. It attends over rows [0, position) of the caches and
the rows it computes, so it reads no row its own step writes: LlamaDecodeStep writes the rows at
`position` with index_copy, the KV write zero-copy proves and aliases (kvwrite.readers). The
MEGAKERNEL engine runs the op and the writes as one kernel (cc/engines/megakernel), writing the rows
in place. Its implementation here is the reference the kernel is held to: transformers' own
operations, in the weights' dtype, in transformers' order.

The weights are a flat list: per layer input_norm, qkv (q, k and v stacked), o, post_norm, gate,
up, down; then embedding, lm_head, final_norm and the rotary inv_freq (float32). The caches are
[1, kv_heads, capacity, head_dim] each, k and v per layer in turn.
"""

from __future__ import annotations

import torch

from zerokv.errors import ZeroKVError
from zerokv.kvwrite import declare_reads_rows_before

LAYER_WEIGHTS = ("input_norm", "qkv", "o", "post_norm", "gate", "up", "down")
MODEL_WEIGHTS = ("embedding", "lm_head", "final_norm", "inv_freq")
# The shapes the kernel takes: kHeadDim, kGroup, kMaxLayers, kSegment and kMaxWidth in
# cc/engines/megakernel/llama_decode_step.h, which export must not need (limits_test holds them equal).
HEAD_DIM = 64
QUERY_HEADS_PER_KV_HEAD = 4
MAX_LAYERS = 32
SEGMENT = 512  # a tile's columns: the widths of the products must be multiples of it
MAX_WIDTH = 8192  # the widest product the step is tested with (Llama-3.2-1B's MLP): the widths must be at most it
# Rotary embeddings whose frequencies do not depend on the sequence: the step takes them once.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MODEL_CLASSES = ("LlamaForCausalLM",)


class LlamaStepError(ZeroKVError, ValueError):
    """The model or the step's inputs are not ones the step takes; the message names the one at fault."""


@torch.library.custom_op("zerokv::llama_decode_step", mutates_args=())
def llama_decode_step(input_ids: torch.Tensor, cache_position: torch.Tensor, caches: list[torch.Tensor],
                      weights: list[torch.Tensor], rms_eps: float,
                      rope_attention_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _reference_step(input_ids, cache_position, caches, weights, rms_eps, rope_attention_scaling)


@llama_decode_step.register_fake
def _(input_ids, cache_position, caches, weights, rms_eps, rope_attention_scaling):
    embedding = weights[-len(MODEL_WEIGHTS)]
    _, kv_heads, _, head_dim = caches[0].shape
    logits = embedding.new_empty((1, 1, embedding.shape[0]))
    return logits, caches[0].new_empty((len(caches), 1, kv_heads, 1, head_dim))


declare_reads_rows_before(torch.ops.zerokv.llama_decode_step.default, lambda node: (node.args[1], tuple(node.args[2])))


def _rms_norm(x, weight, eps):
    # transformers' LlamaRMSNorm: float32 statistics, the product in the input's dtype.
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _reference_step(input_ids, cache_position, caches, weights, rms_eps, rope_attention_scaling):
    layers = len(caches) // 2
    embedding, lm_head, final_norm, inv_freq = weights[len(LAYER_WEIGHTS) * layers:]
    dtype = embedding.dtype
    _, kv_heads, capacity, head_dim = caches[0].shape
    position = int(cache_position.reshape(-1)[0])
    if not 0 <= position < capacity:
        raise LlamaStepError(f"cache_position {position} is outside the caches' {capacity} positions")
    token = int(input_ids.reshape(-1)[0])
    if not 0 <= token < embedding.shape[0]:
        raise LlamaStepError(f"input_ids {token} is outside the vocabulary of {embedding.shape[0]} tokens")
    freqs = inv_freq.float() * position
    angles = torch.cat((freqs, freqs))
    cos = (angles.cos() * rope_attention_scaling).to(dtype)
    sin = (angles.sin() * rope_attention_scaling).to(dtype)
    x = embedding[token][None]
    rows = []
    for layer in range(layers):
        input_norm, qkv, o, post_norm, gate, up, down = weights[len(LAYER_WEIGHTS) * layer:][:len(LAYER_WEIGHTS)]
        heads = o.shape[1] // head_dim
        projected = torch.nn.functional.linear(_rms_norm(x, input_norm, rms_eps), qkv)
        q, k, v = projected.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(heads, 1, head_dim)
        k = k.view(kv_heads, 1, head_dim)
        v = v.view(kv_heads, 1, head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rows += [k[None], v[None]]
        keys = torch.cat((caches[2 * layer][0, :, :position], k), dim=1)
        values = torch.cat((caches[2 * layer + 1][0, :, :position], v), dim=1)
        attention = torch.nn.functional.scaled_dot_product_attention(
            q[None], keys[None], values[None], scale=head_dim ** -0.5, enable_gqa=True)
        x = x + torch.nn.functional.linear(attention.reshape(1, heads * head_dim), o)
        normed = _rms_norm(x, post_norm, rms_eps)
        activated = torch.nn.functional.silu(torch.nn.functional.linear(normed, gate))
        x = x + torch.nn.functional.linear(activated * torch.nn.functional.linear(normed, up), down)
    logits = torch.nn.functional.linear(_rms_norm(x, final_norm, rms_eps), lm_head)
    return logits.view(1, 1, -1), torch.stack(rows)


def unsupported_model(model) -> str | None:
    """Why the step cannot be `model`'s decode step, or None: the model must be transformers' Llama
    (its code is what the step computes) in BF16, of the shapes the kernel's thread mapping takes."""
    name = type(model).__name__
    if name not in MODEL_CLASSES or type(model).__module__ != "transformers.models.llama.modeling_llama":
        return f"{name} is not transformers' {' or '.join(MODEL_CLASSES)}: the step computes Llama's code only"
    config = model.config
    rotary = model.model.rotary_emb
    checks = (
        (model.dtype == torch.bfloat16, f"its dtype is {model.dtype}; the kernel reads BF16 weights"),
        (config.hidden_act == "silu", f"hidden_act is {config.hidden_act!r}; the step's MLP is SiLU-gated"),
        (not config.attention_bias and not config.mlp_bias, "its projections have biases; the step has none"),
        (rotary.rope_type in STATIC_ROPE_TYPES,
         f"rope type {rotary.rope_type!r}: its frequencies change with the sequence; the step takes them once "
         f"({', '.join(STATIC_ROPE_TYPES)})"),
        (config.head_dim == HEAD_DIM, f"head_dim is {config.head_dim}, not {HEAD_DIM}"),
        (config.num_attention_heads == QUERY_HEADS_PER_KV_HEAD * config.num_key_value_heads,
         f"{config.num_attention_heads} query heads for {config.num_key_value_heads} KV heads; the kernel "
         f"takes {QUERY_HEADS_PER_KV_HEAD} per KV head"),
        (1 <= config.num_hidden_layers <= MAX_LAYERS, f"{config.num_hidden_layers} layers, not 1 to {MAX_LAYERS}"),
        (getattr(config, "layer_types", None) is None or set(config.layer_types) == {"full_attention"},
         "some layers use sliding-window attention; the step attends over every committed position"),
    )
    for holds, reason in checks:
        if not holds:
            return reason
    for what, width in (("hidden_size", config.hidden_size), ("intermediate_size", config.intermediate_size),
                        ("num_attention_heads x head_dim", config.num_attention_heads * config.head_dim)):
        if width % SEGMENT:
            return f"{what} is {width}, not a multiple of {SEGMENT} (a tile's columns)"
        if width > MAX_WIDTH:
            return f"{what} is {width}, wider than {MAX_WIDTH} (the widest product the step is tested with)"
    return None


def model_weights(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the step's weights, in the op's order, from `model`'s own tensors (only q,
    k and v are new: stacked into one matrix). Tied tensors are the same tensor."""
    weights = []
    for index, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).detach()
        tensors = (layer.input_layernorm.weight, qkv, attention.o_proj.weight, layer.post_attention_layernorm.weight,
                   mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        weights += [(f"layers.{index}.{name}", tensor) for name, tensor in zip(LAYER_WEIGHTS, tensors)]
    rotary = model.model.rotary_emb
    tensors = (model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight, rotary.inv_freq.float())
    return weights + list(zip(MODEL_WEIGHTS, tensors))


class LlamaDecodeStep(torch.nn.Module):
    """forward(input_ids [1, 1], cache_position [1], *caches) -> logits [1, 1, vocab]: one decode
    step of a transformers Llama model, which writes its K and V rows into the caches (BF16
    [1, kv_heads, capacity, head_dim], K then V of each layer) at cache_position."""

    def __init__(self, model):
        super().__init__()
        reason = unsupported_model(model)
        if reason:
            raise LlamaStepError(f"model: {reason}")
        self.rms_eps = float(model.config.rms_norm_eps)
        self.rope_attention_scaling = float(model.model.rotary_emb.attention_scaling)
        # One buffer per distinct tensor: a tied weight is one constant of the program.
        self.weight_names = []
        buffers = {}
        for _, tensor in model_weights(model):
            if id(tensor) not in buffers:
                buffers[id(tensor)] = f"weight_{len(buffers)}"
                self.register_buffer(buffers[id(tensor)], tensor.detach())
            self.weight_names.append(buffers[id(tensor)])

    def forward(self, input_ids, cache_position, *caches):
        logits, rows = torch.ops.zerokv.llama_decode_step(
            input_ids, cache_position, list(caches), [getattr(self, name) for name in self.weight_names],
            self.rms_eps, self.rope_attention_scaling)
        for index, cache in enumerate(caches):
            cache.index_copy_(2, cache_position, rows[index])
        return logits
