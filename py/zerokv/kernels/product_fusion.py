"""Folds a decoder's RMS norms and residual additions into the one-token products around them.

A decoder layer reads its input through an RMS norm into its attention's projections, adds the
attention's output projection to the residual stream, norms the sum into its MLP, and adds the MLP's
down projection back. In a decode step each norm and each addition is a kernel of its own between
two products, over a few KiB: what it costs is its launch and the wait for the kernel before it. The
zerokv product ops take both (zerokv.kernels.matvec): `norm_weight` and `norm_eps` make the product
read RMSNorm(x) (x times rsqrt(mean(x^2) + eps) times the weight; the sum of squares is taken as x
is read, and the scale, one number, applied to the sums), and `residual` is added to the product
before it is stored. On Llama-3.2-1B's shape that is two kernels a layer fewer.

fuse_rms_norms matches the RMS norm Llama's code computes (transformers copies it into Qwen2,
Qwen3, Mistral and others), as torch.export spells it:

    a = x.to(float32)                      (absent when x is float32)
    n = a * rsqrt(mean(a ** 2, -1, keepdim=True) + eps)
    y = weight * n.to(x.dtype)             (either order; the cast absent when x is float32)

where y is the input of a zerokv product. A norm of another form (Gemma's 1 + weight, a norm over
another dimension) is left as it is. fuse_residual_additions matches `residual + matvec(...)`
(either order) where the sum is the product's only use and both are of one shape and dtype.

The fused product differs from the graph it replaces in rounding only: the graph rounds the normed
x to the model's dtype, then its product with the weight, then the product and then the sum; the
kernel keeps them in float32 and rounds the output once.

They run on the graph AOTInductor compiles (zerokv.aoti.compile_aoti), after
zerokv.kernels.sibling_matvecs has grouped the projections, and need no Triton.
"""

from __future__ import annotations

import numbers

import torch

from zerokv.kernels.matvec_contract import DTYPES
from zerokv.kernels.sibling_matvecs import op_name

NORMED_PRODUCTS = ("zerokv::matvec", "zerokv::gated_matvec", "zerokv::matvec_siblings")


def fuse_rms_norms(graph: torch.fx.Graph, owner: torch.nn.Module) -> list[str]:
    """Makes each zerokv product that reads an RMS norm's output read the norm's input, normed in
    its kernel; returns the names of the products changed. `owner`: the module whose attributes the
    graph's get_attr nodes name (an eps may be one)."""
    fused = []
    for call in list(graph.nodes):
        if call.op != "call_function" or op_name(call.target) not in NORMED_PRODUCTS:
            continue
        if call.kwargs.get("norm_weight") is not None:
            continue
        x = call.args[0]
        # An alias (the output head's slice of the last position, of one position) is x itself.
        norm = _rms_norm(x.args[0] if _is(x, "aten::alias") else x, owner)
        if norm is None:
            continue
        source, weight, eps = norm
        call.args = (source, *call.args[1:])
        call.kwargs = {**call.kwargs, "norm_weight": weight, "norm_eps": eps}
        fused.append(call.name)
        _erase_unused(x)
    graph.lint()
    return fused


def fuse_residual_additions(graph: torch.fx.Graph) -> list[str]:
    """Makes each `residual + zerokv::matvec(...)` one matvec call that adds the residual; returns
    the names of the additions folded."""
    fused = []
    for add in list(graph.nodes):
        if not _is(add, "aten::add") or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
            continue
        for product, residual in (add.args, add.args[::-1]):
            if (isinstance(product, torch.fx.Node) and op_name(product.target) == "zerokv::matvec"
                    and isinstance(residual, torch.fx.Node) and len(product.users) == 1
                    and product.kwargs.get("residual") is None
                    and _same_shape_and_dtype(product, residual, add)):
                with graph.inserting_before(add):
                    summed = graph.call_function(product.target, product.args,
                                                 {**product.kwargs, "residual": residual})
                summed.meta = dict(add.meta)
                add.replace_all_uses_with(summed)
                graph.erase_node(add)
                graph.erase_node(product)
                fused.append(add.name)
                break
    graph.lint()
    return fused


def _rms_norm(y, owner):
    """(x, weight, eps) when `y` is Llama's RMS norm of x, else None."""
    if not _is(y, "aten::mul") or _dtype(y) not in DTYPES:
        return None
    for weight, cast in (y.args, y.args[::-1]):
        if not (isinstance(weight, torch.fx.Node) and _dtype(weight) == _dtype(y) and _shape(weight) is not None
                and len(_shape(weight)) == 1):
            continue
        normed = _cast_from(cast, _dtype(y))
        if normed is None or not _is(normed, "aten::mul"):
            continue
        for upcast, scale in (normed.args, normed.args[::-1]):
            eps = _inverse_rms_eps(scale, upcast, owner)
            source = _cast_from(upcast, torch.float32)
            if eps is not None and source is not None and _dtype(source) == _dtype(y) \
                    and _shape(source) is not None and _shape(source)[-1:] == _shape(weight):
                return source, weight, eps
    return None


def _inverse_rms_eps(scale, upcast, owner):
    """eps when `scale` is rsqrt(mean(upcast ** 2, -1, keepdim=True) + eps), else None."""
    if not _is(scale, "aten::rsqrt") or not _is(scale.args[0], "aten::add"):
        return None
    for mean, eps in (scale.args[0].args, scale.args[0].args[::-1]):
        eps = _number(eps, owner)
        if eps is None or not _is(mean, "aten::mean") or len(mean.args) < 2:
            continue
        squares, dims = mean.args[0], mean.args[1]
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        rank = len(_shape(upcast) or ())
        if (keepdim and isinstance(dims, (list, tuple)) and list(dims) in ([-1], [rank - 1]) and _is(squares, "aten::pow")
                and squares.args[0] is upcast and squares.args[1] == 2 and not mean.kwargs.get("dtype")):
            return eps
    return None


def _cast_from(node, dtype):
    """What `node` casts to `dtype` (node itself when it already is of it), or None."""
    if _dtype(node) != dtype:
        return None
    if _is(node, "aten::_to_copy") and set(node.kwargs) == {"dtype"}:
        return node.args[0]
    return node


def _number(value, owner):
    """`value` as a Python float: a number, or a get_attr of a one-element tensor of `owner`."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.fx.Node) and value.op == "get_attr":
        tensor = owner
        for name in value.target.split("."):
            tensor = getattr(tensor, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 and tensor.dtype.is_floating_point:
            return float(tensor.item())
    return None


def _same_shape_and_dtype(*nodes):
    values = [node.meta.get("val") for node in nodes]
    return all(isinstance(value, torch.Tensor) for value in values) and len(
        {(tuple(value.shape), value.dtype) for value in values}) == 1


def _is(node, name):
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and op_name(node.target) == name


def _dtype(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _shape(node):
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _erase_unused(node):
    """Erases `node` if nothing reads it (but checks of its dtype, which go with it) and it is a pure
    ATen op or a get_attr, and then what only it read: the norm the products no longer read, up to
    its input and weight."""
    if not isinstance(node, torch.fx.Node) or not (node.op == "get_attr" or (
            node.op == "call_function" and (op_name(node.target) or "").startswith("aten::")
            and not node.is_impure())):
        return
    if any(not _is(user, "aten::_assert_tensor_metadata") for user in node.users):
        return
    for check in list(node.users):
        node.graph.erase_node(check)
    inputs = node.all_input_nodes
    node.graph.erase_node(node)
    for read in inputs:
        _erase_unused(read)
