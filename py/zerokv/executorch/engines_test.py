"""The engine adapters' answers about KV writes, asked of Edge-dialect nodes as the partitioner does."""

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch import fx

from zerokv import kvwrite
from zerokv.executorch.engines import TensorRTEngine, aten_target

aten = torch.ops.aten


def _edge_writes():
    """A hand-built Edge graph: an index_copy and an index_put of a cache, and an add."""
    graph = fx.Graph()
    cache, update, positions = (graph.placeholder(name) for name in ("cache", "update", "positions"))
    copied = graph.call_function(exir_ops.edge.aten.index_copy.default, (cache, 2, positions, update))
    put = graph.call_function(exir_ops.edge.aten.index_put.default, (cache, [None, None, positions], update))
    total = graph.call_function(exir_ops.edge.aten.add.Tensor, (copied, put))
    graph.output((total,))
    return copied, put, total


def test_a_kv_write_is_recognised_in_the_edge_dialect():
    copied, put, total = _edge_writes()
    assert [kvwrite.is_kv_write(node) for node in (copied, put, total)] == [True, True, False]
    assert [aten_target(node) for node in (copied, put)] == [aten.index_copy.default, aten.index_put.default]


def test_tensorrt_takes_the_kv_writes_whose_positions_kvwrite_describes():
    copied, put, _ = _edge_writes()
    assert TensorRTEngine().supports(copied)
    assert not TensorRTEngine().supports(put)
