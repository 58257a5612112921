"""Constant folding that, unlike inductor's default, also folds constructors.

Lowering pipelines (Torch-TensorRT's `constant_fold` among them) fold
`arange`/`full` too, which turns a static-length `arange` index into a frozen
constant. The KV write analysis has to give the same answer on either side of
that rewrite, so the tests and the TensorRT lowering fold the same way.
"""

import torch
from torch import fx
from torch._inductor.constant_folding import ConstantFolder, replace_node_with_constant


def fold_constants(graph_module: fx.GraphModule) -> int:
    """Replaces every node computable at compile time with a `get_attr` constant.

    Returns the number of nodes replaced.
    """
    with torch.utils._python_dispatch._disable_current_modes():
        folder = ConstantFolder(graph_module, skip_constructors=False)
        folder.run()
        for node, constant in folder.node_replacements.items():
            replace_node_with_constant(graph_module, node, constant)
    for node in list(graph_module.graph.find_nodes(op="get_attr")):
        if not node.users:
            if hasattr(graph_module, node.target):
                delattr(graph_module, node.target)
            graph_module.graph.erase_node(node)
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    return len(folder.node_replacements)
