"""kvwrite.readers: a reader of rows [0, position) is unaffected by a write of row `position`
alone, indexed by the reader's own position node, and by nothing else."""

import pytest
import torch

from zerokv.kvwrite import declare_reads_rows_before, is_kv_write, unaffected_by


@torch.library.custom_op("zerokv_test::sum_before", mutates_args=())
def sum_before(cache: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return cache[:, :, : int(position[0])].sum()


@sum_before.register_fake
def _(cache, position):
    return cache.new_empty(())


declare_reads_rows_before(torch.ops.zerokv_test.sum_before.default, lambda node: (node.args[1], (node.args[0],)))


class Step(torch.nn.Module):
    def __init__(self, index, dim=2):
        super().__init__()
        self.index, self.dim = index, dim

    def forward(self, cache, position, row):
        total = torch.ops.zerokv_test.sum_before(cache, position)
        cache.index_copy_(self.dim, self.index(position), row)
        return total


def _reader_and_write(index, dim=2, row_shape=(1, 2, 1, 4), position=torch.tensor([3])):
    program = torch.export.export(Step(index, dim), (torch.zeros(1, 2, 8, 4), position, torch.zeros(row_shape)))
    program = program.run_decompositions({})
    (reader,) = [n for n in program.graph.nodes if n.target is torch.ops.zerokv_test.sum_before.default]
    (write,) = [n for n in program.graph.nodes if is_kv_write(n)]
    return reader, write


def test_a_write_of_the_readers_position_alone_cannot_change_what_it_reads():
    assert unaffected_by(*_reader_and_write(lambda position: position))


@pytest.mark.parametrize("index, dim, row_shape, position", [
    (lambda position: position + 1, 2, (1, 2, 1, 4), torch.tensor([3])),  # past the position: not proven
    (lambda position: position, 2, (1, 2, 2, 4), torch.tensor([3, 4])),   # two rows from the position
    (lambda position: position, 3, (1, 2, 8, 1), torch.tensor([3])),      # along another axis
])
def test_any_other_write_is_not_proven_harmless(index, dim, row_shape, position):
    assert not unaffected_by(*_reader_and_write(index, dim, row_shape, position))


def test_an_undeclared_reader_is_never_unaffected():
    reader, write = _reader_and_write(lambda position: position)
    assert not unaffected_by(write, write)
