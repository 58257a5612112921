"""The program an engine compiles for a delegate: ATen ops, with promised cache writes in place.

Inside a zero-copy delegate a caller-owned cache is a plain input whose functional write
(`index_copy(k_cache, ...)`) is no longer a delegate output: the partitioner's caller repointed its
buffer mutation at the buffer itself. The engine must therefore write that input's memory. This
module turns the delegate's Edge program into a torch.export program in which each such write is an
in-place write of the input (`k_cache.index_copy_(...)`), so that the engine sees a mutated input:
what every engine kind knows how to alias (TensorRT's KV cache update layer, AOTInductor's in-place
kernels).
"""

from __future__ import annotations

import copy

import torch
from torch import fx
from torch.export.graph_signature import InputKind, OutputKind

from zerokv.executorch.engine_build import EngineBuildError
from zerokv.executorch.engines import (
    DIM_ORDER_OPS,
    aten_target,
    readers_besides,
    write_backs,
    written_back,
)
from zerokv.kvwrite import is_kv_write

_IN_PLACE = {
    torch.ops.aten.index_copy.default: torch.ops.aten.index_copy_.default,
    torch.ops.aten.index_put.default: torch.ops.aten.index_put_.default,
}


def _drop_dim_order(node: fx.Node, delegate: str):
    """ExecuTorch's dim-order copies became ATen's _to_copy and clone; only the contiguous order has
    a meaning."""
    dim_order = node.kwargs.get("dim_order")
    if dim_order is not None and list(dim_order) != list(range(node.meta["val"].dim())):
        raise EngineBuildError(f"{delegate}: {node.name} asks for dim order {dim_order}; engines take contiguous tensors")
    node.kwargs = {key: value for key, value in node.kwargs.items() if key != "dim_order"}


def user_input_names(program: torch.export.ExportedProgram) -> list[str]:
    return [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]


def _rewrite_in_place(graph_module: fx.GraphModule, aliased_inputs, delegate: str):
    placeholders = {node.name: node for node in graph_module.graph.find_nodes(op="placeholder")}
    for name in aliased_inputs:
        cache = placeholders.get(name)
        if cache is None:
            raise EngineBuildError(f"{delegate}: aliased input '{name}' is not an input of the delegate")
        writes = [user for user in cache.users if is_kv_write(user) and user.args[0] is cache]
        _drop_from_outputs(graph_module, cache, writes)
        others = [user for user in readers_besides(cache, writes[0]) if user.op != "output"] if len(writes) == 1 else []
        if len(writes) != 1 or others:
            raise EngineBuildError(
                f"{delegate}: cache input '{name}' must be written exactly once and read only through "
                f"that write to be updated in place; its users are {[u.name for u in cache.users]}")
        (write,) = writes
        target = aten_target(write)
        if target is torch.ops.aten.slice_scatter.default:
            _slice_scatter_in_place(graph_module, write)
        elif target in _IN_PLACE:
            write.target = _IN_PLACE[target]
        else:
            raise EngineBuildError(f"{delegate}: no in-place form of {target} for cache '{name}'")


def _drop_from_outputs(graph_module: fx.GraphModule, cache: fx.Node, writes):
    """A write of `cache` the delegate returns (a runtime-owned cache's, kept alive to lowering by its
    mutation output) is the input's own memory once in place: the engine returns nothing for it."""
    output_node = graph_module.graph.output_node()
    returned = output_node.args[0]
    kept = tuple(value for value in returned if written_back(value, cache) not in writes)
    output_node.args = (kept,)
    for value in set(returned) - set(kept):
        for copy in write_backs(value, cache):
            if not copy.users:
                graph_module.graph.erase_node(copy)


def _slice_scatter_in_place(graph_module: fx.GraphModule, write: fx.Node):
    cache, source, *rest = write.args
    dim, start, end, step = (list(rest) + [0, None, None, 1][len(rest):])[:4]
    dim = write.kwargs.get("dim", dim)
    start, end, step = write.kwargs.get("start", start), write.kwargs.get("end", end), write.kwargs.get("step", step)
    with graph_module.graph.inserting_before(write):
        window = graph_module.graph.call_function(torch.ops.aten.slice.Tensor, (cache, dim, start, end, step))
        graph_module.graph.call_function(torch.ops.aten.copy_.default, (window, source))
    write.replace_all_uses_with(cache)
    graph_module.graph.erase_node(write)


def _example_inputs(program: torch.export.ExportedProgram, names):
    placeholders = {node.name: node for node in program.graph.find_nodes(op="placeholder")}
    examples, dynamic_shapes = [], []
    dims = {}
    for name in names:
        value = placeholders[name].meta["val"]
        shape, spec = [], {}
        for axis, extent in enumerate(value.shape):
            if isinstance(extent, torch.SymInt):
                symbol = str(extent.node.expr)
                if symbol not in dims:
                    bounds = program.range_constraints.get(extent.node.expr)
                    lower = max(int(bounds.lower), 1) if bounds is not None else 1
                    upper = int(bounds.upper) if bounds is not None and bounds.upper.is_finite else None
                    # The example extent is the original export's (its hint), not the lower bound:
                    # AOTInductor tunes kernels on these sizes, and a cache shrunk to its minimum
                    # capacity would make a prefill's positions index past it.
                    dims[symbol] = (torch.export.Dim(f"d_{symbol}", min=lower, max=upper), int(extent.node.hint))
                spec[axis] = dims[symbol][0]
                shape.append(dims[symbol][1])
            else:
                shape.append(int(extent))
        examples.append(torch.zeros(shape, dtype=value.dtype))
        dynamic_shapes.append(spec or None)
    return tuple(examples), tuple(dynamic_shapes) if dims else None


def _with_constants_as_attributes(program: torch.export.ExportedProgram) -> fx.GraphModule:
    """The program's graph with its user inputs as the only placeholders, named as in the program
    (ExportedProgram.module() would rename them to positional arguments)."""
    graph_module = copy.deepcopy(program.graph_module)
    graph = graph_module.graph
    placeholders = {node.name: node for node in graph.find_nodes(op="placeholder")}
    first_op = next(node for node in graph.nodes if node.op != "placeholder")
    for index, spec in enumerate(program.graph_signature.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.target in program.state_dict:
            value = program.state_dict[spec.target]
        else:
            value = program.constants[spec.target]
        attribute = f"_zerokv_constant_{index}"
        value = value.detach().clone() if isinstance(value, torch.Tensor) else value
        if spec.kind == InputKind.CONSTANT_TENSOR:
            # A plain attribute, which torch.export lifts as a constant again. As a buffer it could
            # be written between calls, and a KV write's index read from it would prove nothing.
            setattr(graph_module, attribute, value)
        else:
            graph_module.register_buffer(attribute, value)
        with graph.inserting_before(first_op):
            fetched = graph.create_node("get_attr", attribute)  # graph.get_attr warns on a plain attribute
        node = placeholders[spec.arg.name]
        fetched.meta = dict(node.meta)
        node.replace_all_uses_with(fetched)
        graph.erase_node(node)
    return graph_module


def engine_program(program: torch.export.ExportedProgram, aliased_inputs, delegate: str):
    """`program` (a delegate's Edge program) as a functional torch.export program over ATen ops in
    which every input named in `aliased_inputs` is a mutated user input, updated by its KV write."""
    graph_module = _with_constants_as_attributes(program)
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            node.target = aten_target(node)
            if node.target in DIM_ORDER_OPS.values():
                _drop_dim_order(node, delegate)
    _rewrite_in_place(graph_module, aliased_inputs, delegate)
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    names = user_input_names(program)
    examples, dynamic_shapes = _example_inputs(program, names)
    exported = torch.export.export(graph_module, examples, dynamic_shapes=dynamic_shapes, strict=False)
    exported = exported.run_decompositions({})  # functional: in-place writes become input mutations
    mutated = {
        spec.target for spec in exported.graph_signature.output_specs if spec.kind == OutputKind.USER_INPUT_MUTATION
    }
    missing = set(aliased_inputs) - mutated
    if missing:
        raise EngineBuildError(f"{delegate}: the caches {sorted(missing)} were promised in-place writes, "
                               "but the engine program does not mutate them")
    return exported
