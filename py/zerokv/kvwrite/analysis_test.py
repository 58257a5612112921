"""Tests of the KV write contiguity analysis on real torch.export graphs."""

import copy

import pytest
import torch
from torch import fx

from zerokv.kvwrite import (
    ContiguousWrite,
    DeclinedWrite,
    analyze_kv_write,
    analyze_kv_writes,
    describe_kv_write,
    describes_positions,
    exported_program_constants,
    is_kv_write,
)
from zerokv.kvwrite.folding import fold_constants

HEADS, MAX_SEQ, HEAD_DIM = 2, 16, 4


class CacheWriter(torch.nn.Module):
    """Writes `update` into a [1, HEADS, MAX_SEQ, HEAD_DIM] cache the way `write` says."""

    def __init__(self, write):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, HEADS, MAX_SEQ, HEAD_DIM))
        self.write = write

    def forward(self, update, offset):
        self.write(self.cache, update, offset)
        return self.cache.sum()


def export(write, length=3, offset=torch.tensor([4]), dynamic=False):
    update = torch.randn(1, HEADS, length, HEAD_DIM)
    dynamic_shapes = ({2: torch.export.Dim("n", min=1, max=8)}, None) if dynamic else None
    program = torch.export.export(CacheWriter(write), (update, offset), dynamic_shapes=dynamic_shapes)
    return program.run_decompositions({})


def only_write(program):
    writes = [n for n in program.graph.nodes if is_kv_write(n)]
    assert len(writes) == 1, [n.format_node() for n in writes]
    return writes[0]


def analyse(program):
    return analyze_kv_write(only_write(program), constants=exported_program_constants(program))


def analyse_folded(program):
    """The same question asked after constant folding, as a partitioner would."""
    module = copy.deepcopy(program.graph_module)
    fold_constants(module)
    writes = [n for n in module.graph.nodes if is_kv_write(n)]
    assert len(writes) == 1
    return analyze_kv_write(writes[0], constants=exported_program_constants(program))


def assert_contiguous(program, start_offset, length, dynamic_terms=()):
    result = analyse(program)
    assert isinstance(result, ContiguousWrite), getattr(result, "reason", result)
    assert result.start.static_offset == start_offset
    assert tuple(n.name for n in result.start.dynamic_terms) == dynamic_terms
    assert result.length == length
    return result


def assert_declined(program, *reason_words):
    result = analyse(program)
    assert isinstance(result, DeclinedWrite), result
    for word in reason_words:
        assert word in result.reason, result.reason
    return result


def assert_same_after_folding(program):
    before, after = analyse(program), analyse_folded(program)
    assert type(before) is type(after), (before, after)
    if isinstance(before, ContiguousWrite):
        assert before.start.key() == after.start.key()
        assert str(before.length) == str(after.length)


class TestIndexCopy:
    def test_static_arange_is_contiguous_from_zero(self):
        program = export(lambda c, u, o: c.index_copy_(2, torch.arange(3), u))
        assert_contiguous(program, 0, 3)
        assert_same_after_folding(program)

    def test_symbolic_arange_keeps_a_symbolic_length(self):
        program = export(
            lambda c, u, o: c.index_copy_(2, torch.arange(u.shape[2]), u), dynamic=True
        )
        result = assert_contiguous(program, 0, length=analyse(program).op.update.meta["val"].shape[2])
        assert isinstance(result.length, torch.SymInt)
        assert_same_after_folding(program)

    def test_arange_start_end_is_contiguous_from_start(self):
        program = export(lambda c, u, o: c.index_copy_(2, torch.arange(5, 8), u))
        assert_contiguous(program, 5, 3)
        assert_same_after_folding(program)

    @pytest.mark.parametrize("offset_first", [False, True], ids=["arange+offset", "offset+arange"])
    @pytest.mark.parametrize(
        "offset", [torch.tensor([4]), torch.tensor(4)], ids=["offset[1]", "offset0d"]
    )
    def test_tensor_offset_in_either_order(self, offset, offset_first):
        def write(c, u, o):
            positions = o + torch.arange(u.shape[2]) if offset_first else torch.arange(u.shape[2]) + o
            c.index_copy_(2, positions, u)

        for dynamic in (False, True):
            program = export(write, offset=offset, dynamic=dynamic)
            result = analyse(program)
            assert isinstance(result, ContiguousWrite), result.reason
            assert result.start.static_offset == 0
            assert [n.name for n in result.start.dynamic_terms] == ["offset"]
            assert_same_after_folding(program)

    def test_single_position_with_one_element_offset(self):
        # Decode: arange(1) and the offset are both [1]-shaped.
        program = export(lambda c, u, o: c.index_copy_(2, torch.arange(1) + o, u), length=1)
        assert_contiguous(program, 0, 1, dynamic_terms=("offset",))

    @pytest.mark.parametrize("offset_first", [False, True])
    def test_python_int_offset_in_either_order(self, offset_first):
        def write(c, u, o):
            c.index_copy_(2, (6 + torch.arange(3)) if offset_first else (torch.arange(3) + 6), u)

        program = export(write)
        assert_contiguous(program, 6, 3)
        assert_same_after_folding(program)

    def test_constant_index_with_an_ascending_run(self):
        program = export(lambda c, u, o: c.index_copy_(2, torch.tensor([7, 8, 9]), u))
        assert_contiguous(program, 7, 3)
        assert_same_after_folding(program)

    def test_folding_turns_an_arange_into_a_constant_with_the_same_answer(self):
        program = export(lambda c, u, o: c.index_copy_(2, torch.arange(3) + 2, u))
        module = copy.deepcopy(program.graph_module)
        fold_constants(module)
        index = describe_kv_write(next(n for n in module.graph.nodes if is_kv_write(n))).index
        assert index.op == "get_attr", "constant folding no longer materialises the arange"
        assert_same_after_folding(program)
        assert analyse_folded(program).start.static_offset == 2

    @pytest.mark.parametrize(
        "positions", [[5, 1, 9], [3, 2, 1], [2, 2, 3]], ids=["scattered", "descending", "repeated"]
    )
    def test_constant_index_that_is_not_a_run_is_declined(self, positions):
        program = export(lambda c, u, o: c.index_copy_(2, torch.tensor(positions), u))
        assert_declined(program, "not an ascending run with step 1")
        assert_same_after_folding(program)

    def test_strided_arange_is_declined(self):
        program = export(lambda c, u, o: c.index_copy_(2, torch.arange(0, 6, 2), u))
        assert_declined(program, "step 2")
        assert_same_after_folding(program)

    def test_runtime_index_is_declined(self):
        program = export(lambda c, u, o: c.index_copy_(2, o, u), offset=torch.tensor([1, 2, 3]))
        assert_declined(program, "runtime value")

    def test_offset_with_many_elements_is_declined(self):
        program = export(
            lambda c, u, o: c.index_copy_(2, torch.arange(3) + o, u), offset=torch.tensor([1, 2, 3])
        )
        assert_declined(program, "shape (3,)")

    def test_write_along_the_heads_dimension_is_declined(self):
        program = export(lambda c, u, o: c.index_copy_(1, torch.arange(HEADS), c * 0 + u.sum()))
        assert_declined(program, "dimension 1", "sequence dimension 2")

    def test_zero_dim_index_is_declined(self):
        result = analyze_kv_write(_hand_built_index_copy(torch.tensor(3)))
        assert isinstance(result, DeclinedWrite)
        assert "rank 0" in result.reason and "rank-1" in result.reason

    def test_rank_two_index_is_declined(self):
        result = analyze_kv_write(_hand_built_index_copy(torch.arange(3)[None]))
        assert isinstance(result, DeclinedWrite)
        assert "rank 2" in result.reason


class TestSliceWrites:
    def test_copy_into_a_static_slice(self):
        def write(c, u, o):
            c[:, :, 4:7].copy_(u)

        program = export(write)
        assert_contiguous(program, 4, 3)
        assert_same_after_folding(program)

    def test_assignment_into_a_symbolic_slice(self):
        def write(c, u, o):
            c[:, :, 2 : 2 + u.shape[2]] = u

        program = export(write, dynamic=True)
        assert_contiguous(program, 2, analyse(program).op.update.meta["val"].shape[2])

    def test_strided_slice_is_declined(self):
        def write(c, u, o):
            c[:, :, 0:6:2] = u

        assert_declined(export(write), "step 2")

    def test_training_ir_copy_into_a_slice_is_recognised(self):
        # Before functionalisation the write is a copy_ whose destination is a slice.
        def write(c, u, o):
            c[:, :, 1:4].copy_(u)

        update = torch.randn(1, HEADS, 3, HEAD_DIM)
        program = torch.export.export(CacheWriter(write), (update, torch.tensor([0])))
        result = analyse(program)
        assert isinstance(result, ContiguousWrite), result.reason
        assert result.op.node.target is torch.ops.aten.copy_.default
        assert result.start.static_offset == 1 and result.length == 3


def test_analyze_kv_writes_covers_every_write_in_order():
    def write(c, u, o):
        c.index_copy_(2, torch.arange(3) + o, u)
        c.index_copy_(2, torch.tensor([5, 1, 9]), u)

    program = export(write)
    results = list(
        analyze_kv_writes(program.graph, constants=exported_program_constants(program)).values()
    )
    assert [type(r) for r in results] == [ContiguousWrite, DeclinedWrite]


def test_describe_names_the_node_that_is_not_a_write():
    program = export(lambda c, u, o: c.index_copy_(2, torch.arange(3), u))
    output = next(n for n in program.graph.nodes if n.op == "output")
    with pytest.raises(ValueError, match="'output'"):
        describe_kv_write(output)


def test_index_put_is_a_kv_write_whose_positions_are_not_described():
    def write(c, u, o):
        c[:, :, torch.arange(3) + o] = u

    program = export(write)
    node = only_write(program)
    assert node.target is torch.ops.aten.index_put.default
    assert not describes_positions(node)
    result = analyse(program)
    assert isinstance(result, DeclinedWrite) and result.op is None
    assert "index tuple" in result.reason and "'index_put'" in result.reason


def _hand_built_index_copy(index_value):
    """An index_copy whose index has a shape aten would refuse at trace time."""
    graph = fx.Graph()
    cache = graph.placeholder("cache")
    cache.meta["val"] = torch.zeros(1, HEADS, MAX_SEQ, HEAD_DIM)
    update = graph.placeholder("update")
    update.meta["val"] = torch.zeros(1, HEADS, 3, HEAD_DIM)
    index = graph.placeholder("index")
    index.meta["val"] = index_value
    write = graph.call_function(torch.ops.aten.index_copy.default, (cache, 2, index, update))
    graph.output((write,))
    return write
