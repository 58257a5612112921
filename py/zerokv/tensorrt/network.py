"""The state shared by converters while an FX graph becomes a TensorRT network.

TensorRT-RTX networks are strongly typed, so every helper here keeps dtypes
explicit: operands are cast to the dtype torch's metadata says the result has,
never left to implicit promotion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import numpy as np
import torch
from torch import fx

from zerokv.blob.torch_dtypes import BLOB_DTYPES, TORCH_DTYPES, type_name
from zerokv.errors import ZeroKVError
from zerokv.tensorrt.trt_module import import_tensorrt


class ConversionError(ZeroKVError, ValueError):
    """An FX node could not be expressed in the TensorRT network; the message names it."""

    def __init__(self, node: fx.Node | None, message: str):
        where = f"node '{node.name}' ({node.target}): " if node is not None else ""
        super().__init__(where + message)
        self.node = node


# A dimension extent: static, or a [1]-shaped int64 shape tensor.
Extent = Union[int, Any]

def trt_dtype(dtype: torch.dtype):
    """TensorRT's type for a torch dtype the blob carries (the types a network binds or holds)."""
    try:
        name = type_name(BLOB_DTYPES[dtype])
    except KeyError:
        raise ValueError(f"dtype {dtype} has no TensorRT equivalent") from None
    return getattr(import_tensorrt(), name)


def torch_dtype(dtype) -> torch.dtype:
    trt = import_tensorrt()
    for blob_dtype, torch_type in TORCH_DTYPES.items():
        if getattr(trt, type_name(blob_dtype)) == dtype:
            return torch_type
    raise ValueError(f"TensorRT dtype {dtype} has no torch equivalent")


def is_tensor(value) -> bool:
    return isinstance(value, import_tensorrt().ITensor)


class NetworkContext:
    """Maps FX nodes to TensorRT values and offers dtype-explicit layer helpers.

    A node's value is an ITensor, a Python int (a static SymInt), a [1]-shaped
    int64 ITensor (a dynamic SymInt), or None for nodes without a result.
    """

    def __init__(self, network):
        self.trt = import_tensorrt()
        self.network = network
        self.values: dict[fx.Node, Any] = {}
        # TensorRT reads constant weights when the plan is built, not when the
        # layer is added: the host memory must outlive the build.
        self._weights_alive: list[torch.Tensor] = []
        self._layer_count = 0
        self.current_node: fx.Node | None = None

    # ----- Values -----------------------------------------------------------

    def value(self, arg):
        """The converted value of `arg`: nodes are looked up, containers recursed."""
        if isinstance(arg, fx.Node):
            if arg not in self.values:
                raise ConversionError(self.current_node, f"input '{arg.name}' was not converted")
            return self.values[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.value(a) for a in arg)
        return arg

    def tensor(self, arg, dtype: torch.dtype | None = None, rank: int | None = None):
        """`arg` as an ITensor, cast to `dtype` if given; scalars become constants of `rank`."""
        value = self.value(arg)
        if not is_tensor(value):
            if isinstance(value, (bool, int, float)):
                if dtype is None:
                    dtype = torch.bool if isinstance(value, bool) else (
                        torch.int64 if isinstance(value, int) else torch.float32
                    )
                shape = (1,) * (rank or 0)
                return self.constant(torch.full(shape, value, dtype=dtype))
            raise ConversionError(self.current_node, f"expected a tensor, got {value!r}")
        return self.cast(value, dtype) if dtype is not None else value

    def constant(self, value: torch.Tensor | np.ndarray):
        """A constant layer holding `value` (kept alive until the plan is built)."""
        tensor = torch.as_tensor(value).detach().cpu().contiguous()
        if tensor.dtype == torch.float64:
            tensor = tensor.to(torch.float32)
        self._weights_alive.append(tensor)
        weights = self.trt.Weights(trt_dtype(tensor.dtype), tensor.data_ptr(), tensor.numel())
        layer = self.network.add_constant(tuple(tensor.shape), weights)
        self.name(layer, "constant")
        return layer.get_output(0)

    def cast(self, tensor, dtype: torch.dtype):
        if tensor.dtype == trt_dtype(dtype):
            return tensor
        layer = self.network.add_cast(tensor, trt_dtype(dtype))
        self.name(layer, "cast")
        return layer.get_output(0)

    def name(self, layer, role: str):
        """Names `layer` after the node being converted, so build errors point at it."""
        self._layer_count += 1
        owner = self.current_node.name if self.current_node is not None else "network"
        layer.name = f"{owner}/{role}#{self._layer_count}"
        return layer

    # ----- Shapes -----------------------------------------------------------

    def shape_of(self, tensor):
        layer = self.network.add_shape(tensor)
        self.name(layer, "shape")
        return self.cast(layer.get_output(0), torch.int64)

    def extent(self, tensor, dim: int) -> Extent:
        """The extent of `tensor` along `dim`: an int where static, else a [1] tensor."""
        static = tensor.shape[dim]
        if static >= 0:
            return static
        index = self.constant(torch.tensor([dim], dtype=torch.int64))
        layer = self.network.add_gather(self.shape_of(tensor), index, 0)
        self.name(layer, "extent")
        return layer.get_output(0)

    def extents(self, tensor) -> list[Extent]:
        return [self.extent(tensor, d) for d in range(len(tensor.shape))]

    def extent_tensor(self, extent: Extent):
        """`extent` as a [1] int64 tensor."""
        if is_tensor(extent):
            return self.cast(self.flatten_scalar(extent), torch.int64)
        return self.constant(torch.tensor([int(extent)], dtype=torch.int64))

    def shape_tensor(self, extents: Sequence[Extent]):
        parts = [self.extent_tensor(e) for e in extents]
        if len(parts) == 1:
            return parts[0]
        layer = self.network.add_concatenation(parts)
        layer.axis = 0
        self.name(layer, "shape")
        return layer.get_output(0)

    def flatten_scalar(self, tensor):
        """A 0-d or [1]-shaped tensor as [1]."""
        if tuple(tensor.shape) == (1,):
            return tensor
        return self.reshape(tensor, [1])

    def reshape(self, tensor, extents: Sequence[Extent]):
        """Reshapes to `extents`; -1 infers one extent, as in torch."""
        layer = self.network.add_shuffle(tensor)
        if all(isinstance(e, int) for e in extents):
            layer.reshape_dims = tuple(extents)
        else:
            layer.set_input(1, self.shape_tensor(extents))
        layer.zero_is_placeholder = False
        self.name(layer, "reshape")
        return layer.get_output(0)

    def permute(self, tensor, order: Sequence[int]):
        layer = self.network.add_shuffle(tensor)
        layer.first_transpose = self.trt.Permutation(list(order))
        self.name(layer, "permute")
        return layer.get_output(0)

    def unsqueeze_front(self, tensor, rank: int):
        """`tensor` with leading unit dimensions up to `rank`, for broadcasting."""
        missing = rank - len(tensor.shape)
        if missing <= 0:
            return tensor
        return self.reshape(tensor, [1] * missing + self.extents(tensor))

    def broadcast_to(self, tensor, extents: Sequence[Extent]):
        """Broadcasts `tensor` to `extents` (stride-0 slices; works with dynamic shapes)."""
        tensor = self.unsqueeze_front(tensor, len(extents))
        strides = [0 if tensor.shape[d] == 1 and extents[d] != 1 else 1 for d in range(len(extents))]
        zeros = [0] * len(extents)
        if all(isinstance(e, int) for e in extents):
            layer = self.network.add_slice(tensor, zeros, list(extents), strides)
        else:
            layer = self.network.add_slice(tensor, zeros, [1] * len(extents), strides)
            layer.set_input(2, self.shape_tensor(extents))
        self.name(layer, "broadcast")
        return layer.get_output(0)

    # ----- Arithmetic -------------------------------------------------------

    def elementwise(self, lhs, rhs, operation, dtype: torch.dtype):
        """`lhs <operation> rhs` computed in `dtype`, broadcasting by rank first."""
        rank = max(len(t.shape) for t in (lhs, rhs) if is_tensor(t)) if (
            is_tensor(lhs) or is_tensor(rhs)
        ) else 0
        lhs = self.unsqueeze_front(self.tensor(lhs, dtype, rank), rank)
        rhs = self.unsqueeze_front(self.tensor(rhs, dtype, rank), rank)
        layer = self.network.add_elementwise(lhs, rhs, operation)
        self.name(layer, str(operation).rsplit(".", 1)[-1].lower())
        return layer.get_output(0)

    def unary(self, tensor, operation):
        layer = self.network.add_unary(tensor, operation)
        self.name(layer, str(operation).rsplit(".", 1)[-1].lower())
        return layer.get_output(0)

    def activation(self, tensor, kind):
        layer = self.network.add_activation(tensor, kind)
        self.name(layer, str(kind).rsplit(".", 1)[-1].lower())
        return layer.get_output(0)

    def extent_arithmetic(self, lhs: Extent, rhs: Extent, operation) -> Extent:
        """Arithmetic on extents, static where both are."""
        if isinstance(lhs, int) and isinstance(rhs, int):
            return _STATIC_EXTENT_OPS[str(operation)](lhs, rhs)
        return self.elementwise(self.extent_tensor(lhs), self.extent_tensor(rhs), operation, torch.int64)

    def arange(self, length: Extent, start: Extent = 0, step: int = 1):
        """int64 positions start, start + step, ..., of `length` elements."""
        if all(isinstance(v, int) for v in (length, start)):
            return self.constant(torch.arange(start, start + length * step, step, dtype=torch.int64))
        layer = self.network.add_fill((1,), self.trt.FillOperation.LINSPACE, self.trt.int64)
        layer.set_input(0, self.extent_tensor(length))
        start_tensor = self.reshape(self.extent_tensor(start), [])
        layer.set_input(1, start_tensor)
        layer.set_input(2, self.constant(torch.tensor([step], dtype=torch.int64)))
        self.name(layer, "arange")
        return layer.get_output(0)


_STATIC_EXTENT_OPS = {
    "ElementWiseOperation.SUM": lambda a, b: a + b,
    "ElementWiseOperation.SUB": lambda a, b: a - b,
    "ElementWiseOperation.PROD": lambda a, b: a * b,
    "ElementWiseOperation.FLOOR_DIV": lambda a, b: a // b,
    "ElementWiseOperation.MIN": min,
    "ElementWiseOperation.MAX": max,
}
