"""The engine adapters: their answers about KV writes, asked of Edge-dialect nodes as the partitioner
does, and their options."""

import pytest
import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch import fx

from zerokv import kvwrite
from zerokv.aoti import AotiCompileError, compile_aoti
from zerokv.errors import ZeroKVError
from zerokv.executorch import aoti_engine
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


@pytest.mark.parametrize("name", ["cuda_graph", "coordinate_descent_tuning"])
def test_aoti_cuda_options_go_through_the_compile_specs(name):
    specs = aoti_engine.options_to_specs({"compile_device": "cuda", name: True})
    options = aoti_engine.options_from_specs(specs)
    assert options[name] is True
    assert [value for key, value in options.items() if key not in (name, "compile_device")] == [False]
    specs = aoti_engine.options_to_specs({"compile_device": "cuda"})
    assert aoti_engine.options_from_specs(specs) == {"compile_device": "cuda", "cuda_graph": False,
                                                     "coordinate_descent_tuning": False}


@pytest.mark.parametrize("options, named", [
    ({"compile_device": "cpu", "cuda_graph": True}, r"'cuda_graph'\] asks for CUDA graphs, which need compile_device 'cuda'"),
    ({"compile_device": "cuda", "cuda_graph": "yes"}, "expected True or False"),
    ({"compile_device": "cpu", "coordinate_descent_tuning": True}, r"'coordinate_descent_tuning'\] .* compile_device 'cuda'"),
    ({"compile_device": "cuda", "coordinate_descent_tuning": 1}, r"'coordinate_descent_tuning'\]: 1; expected True or False"),
])
def test_aoti_cuda_options_are_refused_where_they_cannot_hold(options, named):
    with pytest.raises(ZeroKVError, match=named):
        aoti_engine.options_to_specs(options)


def test_compile_aoti_refuses_cuda_graphs_for_the_cpu():
    with pytest.raises(AotiCompileError, match="CUDA graphs are for CUDA packages"):
        compile_aoti(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), "cpu", cuda_graph=True)


def test_compile_aoti_refuses_coordinate_descent_tuning_for_the_cpu():
    with pytest.raises(AotiCompileError, match="coordinate_descent_tuning: it tunes Triton kernels"):
        compile_aoti(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), "cpu", coordinate_descent_tuning=True)


def test_a_cpu_package_says_it_wants_no_cuda_graph():
    build = compile_aoti(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), "cpu")
    loader = _loaded(build.payload)
    assert loader.get_metadata()["zerokv.cuda_graph"] == "0"


def _loaded(payload):
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "engine.pt2")
        with open(path, "wb") as package:
            package.write(payload)
        return torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
