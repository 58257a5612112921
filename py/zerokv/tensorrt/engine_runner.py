"""Runs a LoweredEngine on a GPU, binding aliased outputs to their inputs' memory.

Test support: it is how a machine with a TensorRT-capable GPU checks converters
against eager PyTorch and checks that the caches really are written in place.
Where no engine can be deserialized, `load_engine` says why instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from zerokv.tensorrt.lowering import LoweredEngine
from zerokv.tensorrt.network import torch_dtype
from zerokv.tensorrt.trt_module import import_tensorrt


class EngineUnavailable(Exception):
    """No engine can be deserialized on this machine; the message says why."""


class EngineRunner:
    """One deserialized engine with an execution context."""

    def __init__(self, lowered: LoweredEngine):
        if not torch.cuda.is_available():
            raise EngineUnavailable(
                "no CUDA device: a TensorRT engine needs a supported GPU to deserialize and run"
            )
        trt = import_tensorrt()
        self._trt = trt
        self._lowered = lowered
        self._logger = trt.Logger(trt.Logger.ERROR)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(lowered.serialized_plan)
        if self.engine is None:
            raise EngineUnavailable(
                "TensorRT could not deserialize the plan on this GPU "
                f"({torch.cuda.get_device_name()}, sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
            )
        self.context = self.engine.create_execution_context()
        self._aliases = {alias.output: alias.input for alias in lowered.aliased_io}
        for output, expected_input in self._aliases.items():
            actual = self.engine.get_aliased_input_tensor(output)
            if actual != expected_input:
                raise AssertionError(f"engine aliases '{output}' to '{actual}', not '{expected_input}'")

    def run(self, inputs: Mapping[str, torch.Tensor], profile: int = 0) -> dict[str, torch.Tensor]:
        """Runs once on CUDA tensors; aliased outputs are returned as their (updated) inputs."""
        stream = torch.cuda.current_stream()
        self.context.set_optimization_profile_async(profile, stream.cuda_stream)
        for binding in self._lowered.io_bindings:
            if binding.is_input:
                tensor = inputs[binding.name]
                if not tensor.is_cuda or not tensor.is_contiguous():
                    raise ValueError(f"input '{binding.name}' must be a contiguous CUDA tensor")
                self.context.set_input_shape(binding.name, tuple(tensor.shape))
                self.context.set_tensor_address(binding.name, tensor.data_ptr())
        outputs = {}
        for binding in self._lowered.io_bindings:
            if binding.is_input:
                continue
            if binding.name in self._aliases:
                tensor = inputs[self._aliases[binding.name]]
            else:
                shape = tuple(self.context.get_tensor_shape(binding.name))
                dtype = torch_dtype(self.engine.get_tensor_dtype(binding.name))
                tensor = torch.empty(shape, dtype=dtype, device="cuda")
            self.context.set_tensor_address(binding.name, tensor.data_ptr())
            outputs[binding.name] = tensor
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()
        return outputs
