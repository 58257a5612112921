"""compile_aoti's binding table and in-place rewrite (no AOTInductor compile: those are the
runtime's build outputs, //py/zerokv/aoti:decode_blobs, exercised by //cc/runtime:backend_aoti_test)."""

import pytest
import torch

from zerokv import blob
from zerokv.aoti.compile import _binding_table, _export, _rewrite_in_place


class MutatingStep(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        k_cache.index_copy_(2, pos, x)
        return (k_cache * 2).sum(2)


class FunctionalStep(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        updated = torch.index_copy(k_cache, 2, pos, x)
        return updated.sum(2) * 0 + x.sum(2), updated


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


def test_a_returned_functional_update_is_rewritten_in_place():
    module = torch.export.export(FunctionalStep(), _inputs()).module()
    rewritten = _rewrite_in_place(module, {1: "k_cache"})
    bindings, aliased_io = _table(rewritten, _inputs())
    assert aliased_io == [blob.AliasedIO("k_cache_out", "k_cache", blob.AliasKind.KV_CACHE_UPDATE)]
    assert [b.name for b in bindings if b.direction == blob.Direction.OUTPUT][0] == "k_cache_out"
    # Run eagerly: the cache is now updated in place and no longer returned.
    x, pos, cache = _inputs()
    outputs = rewritten(x, pos, cache)
    assert len(outputs) == 1 and cache[0, 0, 3, 0] == 1.0


class LateReadStep(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        updated = torch.index_copy(k_cache, 2, pos, x)
        return k_cache.sum(2), updated


def test_a_read_of_the_original_input_after_the_write_is_refused():
    module = torch.export.export(LateReadStep(), _inputs()).module()
    with pytest.raises(ValueError, match="after output 1 updates it"):
        _rewrite_in_place(module, {1: "k_cache"})


def test_a_write_that_is_not_an_index_copy_is_refused():
    module = torch.export.export(FunctionalStep(), _inputs()).module()
    with pytest.raises(ValueError, match="not an index_copy/index_put of input 'x'"):
        _rewrite_in_place(module, {1: "x"})
    with pytest.raises(ValueError, match="names output 5"):
        _rewrite_in_place(module, {5: "k_cache"})


def test_an_engine_owned_buffer_mutation_is_refused():
    with pytest.raises(ValueError, match="mutates buffer 'k_cache'"):
        _table(BufferStep(), _inputs()[:2])
