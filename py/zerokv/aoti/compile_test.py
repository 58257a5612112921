"""compile_aoti's binding table (no AOTInductor compile: those are the runtime's build outputs,
//py/zerokv/aoti:decode_blobs, exercised by //cc/runtime:backend_aoti_test)."""

import pytest
import torch

from zerokv import blob
from zerokv.aoti.compile import _binding_table, _export


class MutatingStep(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        k_cache.index_copy_(2, pos, x)
        return (k_cache * 2).sum(2)


class BufferStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, 8, 4))

    def forward(self, x, pos):
        self.k_cache.index_copy_(2, pos, x)
        return self.k_cache.sum(2)


def _inputs():
    return (torch.ones(1, 2, 1, 4), torch.tensor([3]), torch.zeros(1, 2, 8, 4))


def _table(module, inputs, device=blob.Device.CUDA):
    return _binding_table(_export(module, inputs, None), device)


def test_a_mutated_input_is_an_aliased_output_binding():
    bindings, aliased_io = _table(MutatingStep(), _inputs())
    assert [(b.name, b.direction) for b in bindings] == [
        ("x", blob.Direction.INPUT),
        ("pos", blob.Direction.INPUT),
        ("k_cache", blob.Direction.INPUT),
        ("k_cache_out", blob.Direction.OUTPUT),
        ("sum_1", blob.Direction.OUTPUT),
    ]
    assert aliased_io == [blob.AliasedIO("k_cache_out", "k_cache", blob.AliasKind.KV_CACHE_UPDATE)]
    assert bindings[3].shape == bindings[2].shape == [blob.Dim(n, n) for n in (1, 2, 8, 4)]
    assert bindings[1].dtype == blob.DType.INT64
    assert all(b.device == blob.Device.CUDA for b in bindings)


def test_an_engine_owned_buffer_mutation_is_refused():
    with pytest.raises(ValueError, match="mutates buffer 'k_cache'"):
        _table(BufferStep(), _inputs()[:2])
