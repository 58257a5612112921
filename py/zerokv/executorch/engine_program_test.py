"""engine_program: a delegate's program with its promised cache writes made in-place input writes."""

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

from zerokv import kvwrite
from zerokv.executorch.engine_build import EngineBuildError
from zerokv.executorch.engine_program import engine_program


class FunctionalStep(torch.nn.Module):
    """What a zero-copy delegate receives: the cache's write is read, but no longer returned."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x, pos, k_cache):
        updated = torch.index_copy(k_cache, 2, pos, x)
        return (updated * self.scale).sum(2)


class ConstantIndexStep(torch.nn.Module):
    def forward(self, x, k_cache):
        return torch.index_copy(k_cache, 2, torch.tensor([5, 6, 7]), x).sum(2)


class ReadBesidesWrite(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        return k_cache.sum(2) + torch.index_copy(k_cache, 2, pos, x).sum(2)


class NeverWritten(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        return k_cache.sum(2) + x.sum(2)


def _inputs():
    return (torch.ones(1, 2, 1, 4), torch.tensor([3]), torch.zeros(1, 2, 8, 4))


def _export(module):
    return _export_with(module, _inputs())


def _export_with(module, inputs):
    with torch.no_grad():
        return torch.export.export(module, inputs)


def test_a_promised_write_becomes_a_mutation_of_the_input():
    program = engine_program(_export(FunctionalStep()), ["k_cache"], "test delegate")
    mutations = [spec.target for spec in program.graph_signature.output_specs
                 if spec.kind == OutputKind.USER_INPUT_MUTATION]
    assert mutations == ["k_cache"]
    assert list(program.graph_signature.user_inputs) == ["x", "pos", "k_cache"]
    # Run it: the caller's cache is written in place, and the result is the functional step's.
    x, pos, cache = _inputs()
    (result,) = program.module()(x, pos, cache)
    assert cache[0, 0, 3].tolist() == [1.0] * 4 and cache.sum() == 8.0
    torch.testing.assert_close(result, FunctionalStep()(x, pos, torch.zeros(1, 2, 8, 4)))


def test_a_cache_read_besides_its_write_is_refused():
    with pytest.raises(EngineBuildError, match="test delegate: cache input 'k_cache' must be written exactly once"):
        engine_program(_export(ReadBesidesWrite()), ["k_cache"], "test delegate")


def test_a_cache_that_is_never_written_is_refused():
    with pytest.raises(EngineBuildError, match="cache input 'k_cache' must be written exactly once"):
        engine_program(_export(NeverWritten()), ["k_cache"], "test delegate")


def test_an_unknown_cache_is_refused():
    with pytest.raises(EngineBuildError, match="aliased input 'v_cache' is not an input of the delegate"):
        engine_program(_export(FunctionalStep()), ["v_cache"], "test delegate")


def _write_verdict(program):
    (write,) = [node for node in program.graph.nodes if kvwrite.is_kv_write(node)]
    return kvwrite.analyze_kv_write(write, constants=kvwrite.exported_program_constants(program))


def test_a_constant_index_stays_a_constant_so_its_proof_holds():
    # Functional, as zerokv.export analyses it before partitioning: the constant feeds a clone.
    original = _export_with(ConstantIndexStep(), (torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 8, 4)))
    original = original.run_decompositions({})
    program = engine_program(original, ["k_cache"], "test delegate")
    kinds = [spec.kind for spec in program.graph_signature.input_specs if spec.kind != InputKind.USER_INPUT]
    assert kinds == [InputKind.CONSTANT_TENSOR]
    before, after = _write_verdict(original), _write_verdict(program)
    assert isinstance(before, kvwrite.ContiguousWrite), before
    assert isinstance(after, kvwrite.ContiguousWrite), after
    assert (after.start.key(), after.length) == (before.start.key(), before.length) == ((5, ()), 3)
