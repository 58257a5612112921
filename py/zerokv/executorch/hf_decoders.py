"""Small Hugging Face decoders with random weights, exported the way transformers' own ExecuTorch
integration exports them (static cache: per-layer K/V buffers written with index_copy_, a rotary
inv_freq and per-layer cumulative_length buffers). Nothing is downloaded: configs are built here.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

MAX_CACHE_LEN = 32


def tiny_llama(seed: int = 0):
    """A 2-layer Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=2 * MAX_CACHE_LEN)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": MAX_CACHE_LEN}
    return model


def export_decode(model):
    """The one-token decode step: (input_ids [1, 1], cache_position [1]) -> logits."""
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        return exportable.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))


def export_prefill(model, max_tokens: int = MAX_CACHE_LEN // 2):
    """The prefill: (input_ids [1, T], cache_position [T]) -> logits, T dynamic in [2, max_tokens]."""
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    tokens = torch.export.Dim("tokens", min=2, max=max_tokens)
    with torch.no_grad():
        return exportable.export(input_ids=torch.ones(1, 4, dtype=torch.long), cache_position=torch.arange(4),
                                 dynamic_shapes={"input_ids": {1: tokens}, "cache_position": {0: tokens}})
