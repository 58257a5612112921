"""Evaluates a built TensorRT network with PyTorch on the CPU, layer by layer.

Test support for machines where no engine can run. It reads each layer's
parameters back from the INetworkDefinition and applies TensorRT's documented
semantics for the layer types zerokv emits, so converter mistakes (a wrong
axis, a transposed operand, a dropped write) show up as a mismatch with eager
PyTorch. It is a model of TensorRT, not TensorRT: agreement here does not prove
the engine's kernels agree; the GPU test (engine_runner) does that.

A KV-cache-update layer is applied in place on the cache input, as the engine
does through the aliased binding.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from zerokv.tensorrt.network import torch_dtype
from zerokv.tensorrt.trt_module import import_tensorrt


class UnsupportedLayerError(NotImplementedError):
    """The evaluator does not model this layer type."""


def evaluate_network(network, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runs `network` on CPU tensors; returns its outputs by name.

    Inputs that a KV-cache-update layer writes are updated in place.
    """
    trt = import_tensorrt()
    values: dict[str, torch.Tensor] = {}
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        if tensor.name not in inputs:
            raise ValueError(f"no value for network input '{tensor.name}'")
        values[tensor.name] = inputs[tensor.name]
    # Layers are stored in creation order, and a layer may be given an input
    # (a shape tensor) created after it: evaluate in dependency order instead.
    pending = [network.get_layer(index) for index in range(network.num_layers)]
    while pending:
        ready = [layer for layer in pending if _inputs_ready(layer, values)]
        if not ready:
            raise ValueError(f"layers {[layer.name for layer in pending[:3]]} wait on inputs nothing produces")
        for layer in ready:
            values[layer.get_output(0).name] = _evaluate_layer(trt, layer, values)
        done = {id(layer) for layer in ready}
        pending = [layer for layer in pending if id(layer) not in done]
    return {network.get_output(i).name: values[network.get_output(i).name] for i in range(network.num_outputs)}


def _inputs_ready(layer, values) -> bool:
    return all(
        layer.get_input(i) is None or layer.get_input(i).name in values for i in range(layer.num_inputs)
    )


def _evaluate_layer(trt, layer, values):
    kind = str(layer.type).rsplit(".", 1)[-1]
    handler = _HANDLERS.get(kind)
    if handler is None:
        raise UnsupportedLayerError(f"layer '{layer.name}' of type {kind}")
    operands = [
        values[layer.get_input(i).name] if layer.get_input(i) is not None else None
        for i in range(layer.num_inputs)
    ]
    # get_layer returns the ILayer base; the bindings downcast by class assignment.
    layer.__class__ = getattr(trt, _CLASSES[kind])
    return handler(trt, layer, operands)


def _constant(trt, layer, operands):
    array = np.array(layer.weights)
    return torch.from_numpy(array.copy()).reshape(tuple(layer.shape))


def _shuffle(trt, layer, operands):
    x = operands[0]
    x = x.permute(list(layer.first_transpose)[: x.dim()])
    if len(operands) > 1 and operands[1] is not None:
        dims = [int(d) for d in operands[1].tolist()]
    elif layer.reshape_dims is not None:
        dims = list(layer.reshape_dims)
    else:
        dims = list(x.shape)
    if layer.zero_is_placeholder:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    x = x.reshape(dims)
    return x.permute(list(layer.second_transpose)[: x.dim()])


def _slice(trt, layer, operands):
    x = operands[0]
    start = _override(layer.start, operands, 1)
    size = _override(layer.shape, operands, 2)
    stride = _override(layer.stride, operands, 3)
    index = []
    for axis in range(x.dim()):
        positions = torch.arange(size[axis]) * stride[axis] + start[axis]
        index.append(positions)
    grid = torch.meshgrid(*index, indexing="ij")
    return x[grid]


def _override(static, operands, position):
    if len(operands) > position and operands[position] is not None:
        return [int(v) for v in operands[position].tolist()]
    return [int(v) for v in static]


_ELEMENTWISE = {
    "SUM": torch.add,
    "SUB": torch.sub,
    "PROD": torch.mul,
    "DIV": lambda a, b: torch.div(a, b, rounding_mode="trunc") if not a.is_floating_point() else a / b,
    "POW": torch.pow,
    "MAX": torch.maximum,
    "MIN": torch.minimum,
    "FLOOR_DIV": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "EQUAL": torch.eq,
    "GREATER": torch.gt,
    "LESS": torch.lt,
    "AND": torch.logical_and,
    "OR": torch.logical_or,
}


def _elementwise(trt, layer, operands):
    a, b = operands
    if a.dim() != b.dim():
        raise ValueError(f"layer '{layer.name}': elementwise operands of ranks {a.dim()} and {b.dim()}")
    return _ELEMENTWISE[str(layer.op).rsplit(".", 1)[-1]](a, b)


_UNARY = {
    "NEG": torch.neg,
    "SIN": torch.sin,
    "COS": torch.cos,
    "EXP": torch.exp,
    "SQRT": torch.sqrt,
    "RECIP": torch.reciprocal,
    "ERF": torch.erf,
    "ABS": torch.abs,
    "NOT": torch.logical_not,
}


def _unary(trt, layer, operands):
    return _UNARY[str(layer.op).rsplit(".", 1)[-1]](operands[0])


def _activation(trt, layer, operands):
    kind = str(layer.type).rsplit(".", 1)[-1]
    x = operands[0]
    return {"SIGMOID": torch.sigmoid, "TANH": torch.tanh, "RELU": torch.relu}[kind](x)


def _reduce(trt, layer, operands):
    x = operands[0]
    axes = [a for a in range(x.dim()) if layer.axes & (1 << a)]
    operation = str(layer.op).rsplit(".", 1)[-1]
    if operation == "AVG":
        return x.mean(dim=axes, keepdim=layer.keep_dims)
    if operation == "SUM":
        return x.sum(dim=axes, keepdim=layer.keep_dims)
    if operation == "MAX":
        return x.amax(dim=axes, keepdim=layer.keep_dims)
    raise UnsupportedLayerError(f"reduce {operation}")


def _softmax(trt, layer, operands):
    (axis,) = [a for a in range(operands[0].dim()) if layer.axes & (1 << a)]
    return torch.softmax(operands[0], dim=axis)


def _matmul(trt, layer, operands):
    a, b = operands
    if layer.op0 == trt.MatrixOperation.TRANSPOSE:
        a = a.transpose(-1, -2)
    if layer.op1 == trt.MatrixOperation.TRANSPOSE:
        b = b.transpose(-1, -2)
    if a.dim() != b.dim():
        raise ValueError(f"layer '{layer.name}': matmul operands of ranks {a.dim()} and {b.dim()}")
    return torch.matmul(a, b)


def _gather(trt, layer, operands):
    data, indices = operands
    axis = layer.axis
    flat = data.index_select(axis, indices.reshape(-1).long())
    return flat.reshape(data.shape[:axis] + indices.shape + data.shape[axis + 1 :])


def _concatenation(trt, layer, operands):
    return torch.cat(operands, dim=layer.axis)


def _shape(trt, layer, operands):
    return torch.tensor(list(operands[0].shape), dtype=torch.int64)


def _fill(trt, layer, operands):
    if layer.operation != trt.FillOperation.LINSPACE:
        raise UnsupportedLayerError(f"fill {layer.operation}")
    (length,) = [int(v) for v in operands[0].tolist()]
    start, step = operands[1].reshape(()), operands[2].reshape(())
    return start + torch.arange(length, dtype=start.dtype) * step


def _cast(trt, layer, operands):
    return operands[0].to(torch_dtype(layer.to_type))


def _select(trt, layer, operands):
    condition, then, otherwise = operands
    return torch.where(condition, then, otherwise)


def _scatter(trt, layer, operands):
    data, indices, updates = operands
    if layer.mode != trt.ScatterMode.ELEMENT:
        raise UnsupportedLayerError(f"scatter {layer.mode}")
    return data.scatter(layer.axis, indices.long(), updates)


def _kv_cache_update(trt, layer, operands):
    cache, update, write_indices = operands
    if layer.cache_mode != trt.KVCacheMode.LINEAR:
        raise UnsupportedLayerError(f"KV cache mode {layer.cache_mode}")
    # out[i, :, writeIndices[i] + s, :] = update[i, :, s, :], written through the
    # cache input's memory.
    for row, start in enumerate(write_indices.tolist()):
        cache[row, :, start : start + update.shape[2], :] = update[row]
    return cache


def _identity(trt, layer, operands):
    return operands[0]


_HANDLERS = {
    "CONSTANT": _constant,
    "SHUFFLE": _shuffle,
    "SLICE": _slice,
    "ELEMENTWISE": _elementwise,
    "UNARY": _unary,
    "ACTIVATION": _activation,
    "REDUCE": _reduce,
    "SOFTMAX": _softmax,
    "MATRIX_MULTIPLY": _matmul,
    "GATHER": _gather,
    "CONCATENATION": _concatenation,
    "SHAPE": _shape,
    "FILL": _fill,
    "CAST": _cast,
    "SELECT": _select,
    "SCATTER": _scatter,
    "KV_CACHE_UPDATE": _kv_cache_update,
    "IDENTITY": _identity,
}

_CLASSES = {
    "CONSTANT": "IConstantLayer",
    "SHUFFLE": "IShuffleLayer",
    "SLICE": "ISliceLayer",
    "ELEMENTWISE": "IElementWiseLayer",
    "UNARY": "IUnaryLayer",
    "ACTIVATION": "IActivationLayer",
    "REDUCE": "IReduceLayer",
    "SOFTMAX": "ISoftMaxLayer",
    "MATRIX_MULTIPLY": "IMatrixMultiplyLayer",
    "GATHER": "IGatherLayer",
    "CONCATENATION": "IConcatenationLayer",
    "SHAPE": "IShapeLayer",
    "FILL": "IFillLayer",
    "CAST": "ICastLayer",
    "SELECT": "ISelectLayer",
    "SCATTER": "IScatterLayer",
    "KV_CACHE_UPDATE": "IKVCacheUpdateLayer",
    "IDENTITY": "IIdentityLayer",
}
