"""Converters from ATen ops of Llama- and Gemma-style decoders to TensorRT layers.

Each converter takes the NetworkContext and the node, reads its inputs' values
from the context and returns the node's value. The result dtype always follows
torch's metadata (`node.meta["val"]`), because TensorRT-RTX networks are strongly
typed and would otherwise disagree with eager PyTorch on promotion.

The KV cache writes have their own converter (kv_cache.py).
"""

from __future__ import annotations

import math
import operator
import types
from collections.abc import Callable, Mapping

import torch
from torch import fx

from zerokv.tensorrt.network import ConversionError, Extent, NetworkContext, is_tensor

aten = torch.ops.aten

Converter = Callable[[NetworkContext, fx.Node], object]
_CONVERTERS: dict[object, Converter] = {}
# Read-only: a converter is registered through `converts`, which refuses a second one for a target.
CONVERTERS: Mapping[object, Converter] = types.MappingProxyType(_CONVERTERS)


def converts(*targets):
    """Registers the decorated converter (or, called on one, that converter) for `targets`."""

    def register(function: Converter) -> Converter:
        taken = [target for target in targets if target in _CONVERTERS]
        if taken:
            raise ValueError(f"two converters registered for {', '.join(map(str, taken))}")
        _CONVERTERS.update(dict.fromkeys(targets, function))
        return function

    return register


def result_dtype(node: fx.Node) -> torch.dtype:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise ConversionError(node, "carries no tensor metadata (meta['val'])")
    return value.dtype


def _arg(node: fx.Node, position: int, name: str, default=None):
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(name, default)


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


# ----- Pass-through and bookkeeping ----------------------------------------


@converts(
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
    aten.lift_fresh_copy.default,
)
def _identity(ctx, node):
    return ctx.value(node.args[0])


@converts(aten._assert_tensor_metadata.default)
def _no_result(ctx, node):
    # A trace-time check whose facts torch.export has already verified.
    return None


@converts(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default)
def _cast(ctx, node):
    return ctx.tensor(node.args[0], result_dtype(node))


# ----- Symbolic sizes ----------------------------------------------------------


@converts(aten.sym_size.int)
def _sym_size(ctx, node):
    tensor = ctx.tensor(node.args[0])
    return ctx.extent(tensor, _axis(node.args[1], len(tensor.shape)))


def _symint_op(operation_name: str):
    def convert(ctx, node):
        operation = getattr(ctx.trt.ElementWiseOperation, operation_name)
        return ctx.extent_arithmetic(ctx.value(node.args[0]), ctx.value(node.args[1]), operation)

    return convert


converts(operator.add)(_symint_op("SUM"))
converts(operator.sub)(_symint_op("SUB"))
converts(operator.mul)(_symint_op("PROD"))
converts(operator.floordiv)(_symint_op("FLOOR_DIV"))


# ----- Elementwise arithmetic ------------------------------------------------


def _binary(operation_name: str):
    def convert(ctx, node):
        dtype = result_dtype(node)
        operation = getattr(ctx.trt.ElementWiseOperation, operation_name)
        lhs, rhs = ctx.value(node.args[0]), ctx.value(node.args[1])
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            rhs = ctx.elementwise(rhs, alpha, ctx.trt.ElementWiseOperation.PROD, dtype)
        return ctx.elementwise(lhs, rhs, operation, dtype)

    return convert


for _target, _operation in (
    (aten.add.Tensor, "SUM"),
    (aten.add.Scalar, "SUM"),
    (aten.sub.Tensor, "SUB"),
    (aten.sub.Scalar, "SUB"),
    (aten.mul.Tensor, "PROD"),
    (aten.mul.Scalar, "PROD"),
    (aten.div.Tensor, "DIV"),
    (aten.div.Scalar, "DIV"),
    (aten.maximum.default, "MAX"),
    (aten.minimum.default, "MIN"),
):
    converts(_target)(_binary(_operation))


def _logical(operation_name: str):
    # Masks combine booleans with bitwise and/or (Hugging Face's sliding-window mask); TensorRT's
    # AND/OR are logical, the same on booleans only.
    def convert(ctx, node):
        if result_dtype(node) != torch.bool:
            raise ConversionError(node, f"only boolean operands are supported, got {result_dtype(node)}")
        return _binary(operation_name)(ctx, node)

    return convert


converts(aten.bitwise_and.Tensor)(_logical("AND"))
converts(aten.bitwise_or.Tensor)(_logical("OR"))


def _comparison(operation_name: str, negate: bool):
    # TensorRT compares with EQUAL, GREATER and LESS; <= and >= are negations.
    def convert(ctx, node):
        lhs, rhs = node.args[0], node.args[1]
        operand_dtype = torch.result_type(_meta_or_scalar(lhs), _meta_or_scalar(rhs))
        operation = getattr(ctx.trt.ElementWiseOperation, operation_name)
        result = ctx.elementwise(ctx.value(lhs), ctx.value(rhs), operation, operand_dtype)
        return ctx.unary(result, ctx.trt.UnaryOperation.NOT) if negate else result

    return convert


def _meta_or_scalar(arg):
    return arg.meta["val"] if isinstance(arg, fx.Node) else arg


for _target, _operation, _negate in (
    (aten.eq.Tensor, "EQUAL", False),
    (aten.eq.Scalar, "EQUAL", False),
    (aten.ne.Tensor, "EQUAL", True),
    (aten.ne.Scalar, "EQUAL", True),
    (aten.lt.Tensor, "LESS", False),
    (aten.lt.Scalar, "LESS", False),
    (aten.gt.Tensor, "GREATER", False),
    (aten.gt.Scalar, "GREATER", False),
    (aten.le.Tensor, "GREATER", True),
    (aten.le.Scalar, "GREATER", True),
    (aten.ge.Tensor, "LESS", True),
    (aten.ge.Scalar, "LESS", True),
):
    converts(_target)(_comparison(_operation, _negate))


@converts(aten.where.self)
def _where(ctx, node):
    dtype = result_dtype(node)
    condition = ctx.tensor(node.args[0])
    options = [ctx.value(node.args[1]), ctx.value(node.args[2])]
    rank = max(len(t.shape) for t in [condition] + [o for o in options if is_tensor(o)])
    condition = ctx.unsqueeze_front(condition, rank)
    options = [ctx.unsqueeze_front(ctx.tensor(o, dtype, rank), rank) for o in options]
    layer = ctx.network.add_select(condition, *options)
    ctx.name(layer, "where")
    return layer.get_output(0)


@converts(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(ctx, node):
    dtype = result_dtype(node)
    return ctx.elementwise(
        ctx.value(node.args[1]), ctx.value(node.args[0]), ctx.trt.ElementWiseOperation.SUB, dtype
    )


@converts(aten.pow.Tensor_Scalar)
def _pow(ctx, node):
    dtype = result_dtype(node)
    base, exponent = ctx.tensor(node.args[0], dtype), node.args[1]
    if exponent == 2:
        # Exact and cheaper than POW, which goes through exp/log.
        return ctx.elementwise(base, base, ctx.trt.ElementWiseOperation.PROD, dtype)
    return ctx.elementwise(base, float(exponent), ctx.trt.ElementWiseOperation.POW, dtype)


def _unary(operation_name: str):
    def convert(ctx, node):
        tensor = ctx.tensor(node.args[0], result_dtype(node))
        return ctx.unary(tensor, getattr(ctx.trt.UnaryOperation, operation_name))

    return convert


for _target, _operation in (
    (aten.neg.default, "NEG"),
    (aten.sin.default, "SIN"),
    (aten.cos.default, "COS"),
    (aten.exp.default, "EXP"),
    (aten.sqrt.default, "SQRT"),
    (aten.reciprocal.default, "RECIP"),
    (aten.erf.default, "ERF"),
    (aten.abs.default, "ABS"),
):
    converts(_target)(_unary(_operation))


@converts(aten.rsqrt.default)
def _rsqrt(ctx, node):
    tensor = ctx.tensor(node.args[0], result_dtype(node))
    return ctx.unary(ctx.unary(tensor, ctx.trt.UnaryOperation.SQRT), ctx.trt.UnaryOperation.RECIP)


# ----- Activations -----------------------------------------------------------


@converts(aten.sigmoid.default)
def _sigmoid(ctx, node):
    return ctx.activation(ctx.tensor(node.args[0], result_dtype(node)), ctx.trt.ActivationType.SIGMOID)


@converts(aten.tanh.default)
def _tanh(ctx, node):
    return ctx.activation(ctx.tensor(node.args[0], result_dtype(node)), ctx.trt.ActivationType.TANH)


@converts(aten.relu.default)
def _relu(ctx, node):
    return ctx.activation(ctx.tensor(node.args[0], result_dtype(node)), ctx.trt.ActivationType.RELU)


@converts(aten.silu.default)
def _silu(ctx, node):
    dtype = result_dtype(node)
    x = ctx.tensor(node.args[0], dtype)
    gate = ctx.activation(x, ctx.trt.ActivationType.SIGMOID)
    return ctx.elementwise(x, gate, ctx.trt.ElementWiseOperation.PROD, dtype)


@converts(aten.gelu.default)
def _gelu(ctx, node):
    dtype = result_dtype(node)
    x = ctx.tensor(node.args[0], dtype)
    ops = ctx.trt.ElementWiseOperation
    approximate = node.kwargs.get("approximate", _arg(node, 1, "approximate", "none"))
    if approximate == "tanh":
        # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
        cube = ctx.elementwise(ctx.elementwise(x, x, ops.PROD, dtype), x, ops.PROD, dtype)
        inner = ctx.elementwise(x, ctx.elementwise(cube, 0.044715, ops.PROD, dtype), ops.SUM, dtype)
        inner = ctx.elementwise(inner, math.sqrt(2.0 / math.pi), ops.PROD, dtype)
        gate = ctx.activation(inner, ctx.trt.ActivationType.TANH)
    elif approximate == "none":
        # 0.5 * x * (1 + erf(x / sqrt(2)))
        gate = ctx.unary(ctx.elementwise(x, math.sqrt(0.5), ops.PROD, dtype), ctx.trt.UnaryOperation.ERF)
    else:
        raise ConversionError(node, f"unknown GELU approximation {approximate!r}")
    gate = ctx.elementwise(ctx.elementwise(gate, 1.0, ops.SUM, dtype), 0.5, ops.PROD, dtype)
    return ctx.elementwise(x, gate, ops.PROD, dtype)


# ----- Reductions and softmax ------------------------------------------------


def _reduce(operation_name: str):
    def convert(ctx, node):
        dtype = result_dtype(node)
        x = ctx.tensor(node.args[0], dtype)
        rank = len(x.shape)
        dims = _arg(node, 1, "dim", None)
        dims = list(range(rank)) if dims is None else ([dims] if isinstance(dims, int) else dims)
        keepdim = _arg(node, 2, "keepdim", False)
        mask = 0
        for dim in dims:
            mask |= 1 << _axis(dim, rank)
        layer = ctx.network.add_reduce(x, getattr(ctx.trt.ReduceOperation, operation_name), mask, keepdim)
        ctx.name(layer, operation_name.lower())
        return layer.get_output(0)

    return convert


converts(aten.mean.dim)(_reduce("AVG"))
converts(aten.sum.dim_IntList)(_reduce("SUM"))
converts(aten.sum.default)(_reduce("SUM"))
converts(aten.amax.default)(_reduce("MAX"))


@converts(aten._softmax.default, aten.softmax.int)
def _softmax(ctx, node):
    dtype = result_dtype(node)
    x = ctx.tensor(node.args[0], dtype)
    return _softmax_along(ctx, x, _axis(node.args[1], len(x.shape)))


def _softmax_along(ctx, x, axis: int):
    layer = ctx.network.add_softmax(x)
    layer.axes = 1 << axis
    ctx.name(layer, "softmax")
    return layer.get_output(0)


# ----- Matrix products ---------------------------------------------------------


def _matmul(ctx, lhs, rhs, transpose_rhs: bool = False):
    if len(lhs.shape) < 2 or len(rhs.shape) < 2:
        raise ConversionError(ctx.current_node, "matrix products of vectors are not supported")
    rank = max(len(lhs.shape), len(rhs.shape))
    lhs, rhs = ctx.unsqueeze_front(lhs, rank), ctx.unsqueeze_front(rhs, rank)
    operation = ctx.trt.MatrixOperation
    layer = ctx.network.add_matrix_multiply(
        lhs, operation.NONE, rhs, operation.TRANSPOSE if transpose_rhs else operation.NONE
    )
    ctx.name(layer, "matmul")
    return layer.get_output(0)


@converts(aten.linear.default)
def _linear(ctx, node):
    dtype = result_dtype(node)
    x, weight = ctx.tensor(node.args[0], dtype), ctx.tensor(node.args[1], dtype)
    out = _matmul(ctx, x, weight, transpose_rhs=True)
    bias = _arg(node, 2, "bias")
    if bias is not None:
        out = ctx.elementwise(out, ctx.tensor(bias, dtype), ctx.trt.ElementWiseOperation.SUM, dtype)
    return out


@converts(aten.matmul.default, aten.mm.default, aten.bmm.default)
def _mm(ctx, node):
    dtype = result_dtype(node)
    return _matmul(ctx, ctx.tensor(node.args[0], dtype), ctx.tensor(node.args[1], dtype))


@converts(aten.addmm.default)
def _addmm(ctx, node):
    dtype = result_dtype(node)
    ops = ctx.trt.ElementWiseOperation
    product = _matmul(ctx, ctx.tensor(node.args[1], dtype), ctx.tensor(node.args[2], dtype))
    alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
    if alpha != 1:
        product = ctx.elementwise(product, float(alpha), ops.PROD, dtype)
    bias = ctx.tensor(node.args[0], dtype)
    if beta != 1:
        bias = ctx.elementwise(bias, float(beta), ops.PROD, dtype)
    return ctx.elementwise(product, bias, ops.SUM, dtype)


@converts(aten.embedding.default)
def _embedding(ctx, node):
    weight = ctx.tensor(node.args[0], result_dtype(node))
    indices = ctx.tensor(node.args[1])
    layer = ctx.network.add_gather(weight, indices, 0)
    ctx.name(layer, "embedding")
    return layer.get_output(0)


@converts(aten.scaled_dot_product_attention.default)
def _scaled_dot_product_attention(ctx, node):
    dtype = result_dtype(node)
    ops = ctx.trt.ElementWiseOperation
    query, key, value = (ctx.tensor(node.args[i], dtype) for i in range(3))
    mask = _arg(node, 3, "attn_mask")
    if _arg(node, 4, "dropout_p", 0.0) != 0.0:
        raise ConversionError(node, "attention dropout is a training-time op")
    if _arg(node, 5, "is_causal", False):
        raise ConversionError(node, "is_causal=True is not supported: export with an explicit attn_mask")
    if node.kwargs.get("enable_gqa", False):
        raise ConversionError(node, "enable_gqa=True is not supported: repeat the KV heads in the model")
    scale = node.kwargs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scores = _matmul(ctx, query, key, transpose_rhs=True)
    scores = ctx.elementwise(scores, float(scale), ops.PROD, dtype)
    if mask is not None:
        mask_tensor = ctx.tensor(mask)
        if mask.meta["val"].dtype == torch.bool:
            blocked = ctx.tensor(float("-inf"), dtype, rank=len(scores.shape))
            rank = len(scores.shape)
            mask_tensor = ctx.unsqueeze_front(mask_tensor, rank)
            layer = ctx.network.add_select(mask_tensor, scores, ctx.unsqueeze_front(blocked, rank))
            ctx.name(layer, "mask")
            scores = layer.get_output(0)
        else:
            scores = ctx.elementwise(scores, ctx.cast(mask_tensor, dtype), ops.SUM, dtype)
    weights = _softmax_along(ctx, scores, len(scores.shape) - 1)
    return _matmul(ctx, weights, value)


# ----- Shape manipulation ----------------------------------------------------


@converts(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.view_copy.default)
def _view(ctx, node):
    x = ctx.tensor(node.args[0])
    return ctx.reshape(x, list(ctx.value(node.args[1])))


@converts(aten.permute.default, aten.permute_copy.default)
def _permute(ctx, node):
    x = ctx.tensor(node.args[0])
    rank = len(x.shape)
    return ctx.permute(x, [_axis(d, rank) for d in node.args[1]])


@converts(aten.transpose.int)
def _transpose(ctx, node):
    x = ctx.tensor(node.args[0])
    rank = len(x.shape)
    order = list(range(rank))
    a, b = _axis(node.args[1], rank), _axis(node.args[2], rank)
    order[a], order[b] = order[b], order[a]
    return ctx.permute(x, order)


@converts(aten.t.default)
def _t(ctx, node):
    x = ctx.tensor(node.args[0])
    return ctx.permute(x, [1, 0]) if len(x.shape) == 2 else x


@converts(aten.unsqueeze.default)
def _unsqueeze(ctx, node):
    x = ctx.tensor(node.args[0])
    extents = ctx.extents(x)
    extents.insert(_axis(node.args[1], len(extents) + 1), 1)
    return ctx.reshape(x, extents)


@converts(aten.squeeze.dim)
def _squeeze(ctx, node):
    x = ctx.tensor(node.args[0])
    extents = ctx.extents(x)
    axis = _axis(node.args[1], len(extents))
    if extents[axis] != 1:
        return x
    del extents[axis]
    return ctx.reshape(x, extents)


@converts(aten.expand.default, aten.expand_copy.default)
def _expand(ctx, node):
    x = ctx.tensor(node.args[0])
    sizes = list(ctx.value(node.args[1]))
    x = ctx.unsqueeze_front(x, len(sizes))
    extents: list[Extent] = [
        ctx.extent(x, d) if isinstance(size, int) and size == -1 else size for d, size in enumerate(sizes)
    ]
    return ctx.broadcast_to(x, extents)


@converts(aten.cat.default)
def _cat(ctx, node):
    dtype = result_dtype(node)
    parts = [ctx.tensor(t, dtype) for t in node.args[0]]
    # torch lets empty 1-D tensors join anything; they add nothing.
    parts = [p for p in parts if tuple(p.shape) != (0,)]
    layer = ctx.network.add_concatenation(parts)
    layer.axis = _axis(_arg(node, 1, "dim", 0), len(parts[0].shape))
    ctx.name(layer, "cat")
    return layer.get_output(0)


@converts(aten.slice.Tensor)
def _slice(ctx, node):
    x = ctx.tensor(node.args[0])
    rank = len(x.shape)
    axis = _axis(_arg(node, 1, "dim", 0), rank)
    start, end = ctx.value(_arg(node, 2, "start")), ctx.value(_arg(node, 3, "end"))
    step = _arg(node, 4, "step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConversionError(node, f"slice step {step!r} must be a positive integer")
    extent = ctx.extent(x, axis)
    start = 0 if start is None else start
    if isinstance(start, int) and start < 0:
        start = _from_end(ctx, node, extent, start)
    if end is None or (isinstance(end, int) and isinstance(extent, int) and end >= extent):
        end = extent
    elif isinstance(end, int) and end < 0:
        end = _from_end(ctx, node, extent, end)
    elif not isinstance(extent, int) or is_tensor(end):
        end = ctx.extent_arithmetic(end, extent, ctx.trt.ElementWiseOperation.MIN)
    ops = ctx.trt.ElementWiseOperation
    length = ctx.extent_arithmetic(
        ctx.extent_arithmetic(ctx.extent_arithmetic(end, start, ops.SUB), step - 1, ops.SUM), step, ops.FLOOR_DIV
    )
    starts: list[Extent] = [0] * rank
    starts[axis] = start
    sizes = ctx.extents(x)
    sizes[axis] = length
    strides = [1] * rank
    strides[axis] = step
    static = all(isinstance(v, int) for v in starts + sizes)
    layer = ctx.network.add_slice(
        x,
        starts if static else [0] * rank,
        sizes if static else [1] * rank,
        strides,
    )
    if not static:
        layer.set_input(1, ctx.shape_tensor(starts))
        layer.set_input(2, ctx.shape_tensor(sizes))
    ctx.name(layer, "slice")
    return layer.get_output(0)


def _from_end(ctx, node, extent: Extent, offset: int) -> Extent:
    if isinstance(extent, int):
        return max(extent + offset, 0)
    return ctx.extent_arithmetic(extent, offset, ctx.trt.ElementWiseOperation.SUM)


@converts(aten.select.int)
def _select(ctx, node):
    x = ctx.tensor(node.args[0])
    axis = _axis(node.args[1], len(x.shape))
    index = node.args[2]
    if not isinstance(index, int):
        raise ConversionError(node, "select needs a static index")
    if index < 0:
        if x.shape[axis] < 0:
            raise ConversionError(node, "a negative select index needs a static extent")
        index += x.shape[axis]
    layer = ctx.network.add_gather(x, ctx.constant(torch.tensor(index, dtype=torch.int64)), axis)
    ctx.name(layer, "select")
    return layer.get_output(0)


# ----- Tensor creation -----------------------------------------------------------


@converts(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(ctx, node):
    if node.target is aten.arange.default:
        start, end, step = 0, ctx.value(node.args[0]), 1
    else:
        start, end = ctx.value(node.args[0]), ctx.value(node.args[1])
        step = _arg(node, 2, "step", 1)
    if not isinstance(step, int) or any(isinstance(v, float) for v in (start, end)):
        raise ConversionError(node, "only integer aranges are supported")
    ops = ctx.trt.ElementWiseOperation
    length = ctx.extent_arithmetic(
        ctx.extent_arithmetic(ctx.extent_arithmetic(end, start, ops.SUB), step - 1, ops.SUM), step, ops.FLOOR_DIV
    )
    return ctx.cast(ctx.arange(length, start, step), result_dtype(node))


@converts(aten.full.default)
def _full(ctx, node):
    sizes = list(ctx.value(node.args[0]))
    dtype = result_dtype(node)
    scalar = ctx.tensor(node.args[1], dtype, rank=len(sizes))
    return ctx.broadcast_to(scalar, sizes)


@converts(aten.scalar_tensor.default)
def _scalar_tensor(ctx, node):
    # Masks (Hugging Face's where(mask, 0, min)) decompose to scalar_tensor.
    return ctx.tensor(node.args[0], result_dtype(node), rank=0)


@converts(aten.copy.default)
def _copy(ctx, node):
    # Functional copy: the source broadcast to the destination's shape and dtype.
    destination = ctx.tensor(node.args[0])
    source = ctx.tensor(node.args[1], result_dtype(node))
    return ctx.broadcast_to(source, ctx.extents(destination))
