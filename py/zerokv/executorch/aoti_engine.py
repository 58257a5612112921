"""The AOTInductor engine kind: zerokv.aoti's compile, as an engine build for the blob.

The package is compiled for `compile_device` ("cuda" on a GPU machine; "cpu" on the CPU machines,
where delegates tagged cuda:N run over a host-memory device allocator in tests). The bindings are
CUDA either way: that is where ExecuTorch plans the delegate's I/O.

`cuda_graph` (CUDA packages only) has the runtime capture each run of the package as a CUDA graph
and replay it while the bound addresses and shapes stay the same (cc/engines/aoti): a decode step
is then one graph launch instead of a launch per kernel.
"""

from __future__ import annotations

import torch
from executorch.exir.backend.compile_spec_schema import CompileSpec

from zerokv import blob
from zerokv.aoti import compile_aoti
from zerokv.errors import ZeroKVError
from zerokv.executorch import specs
from zerokv.executorch.engine_build import check_option_names

COMPILE_DEVICE_SPEC = "zerokv.aoti.compile_device"
CUDA_GRAPH_SPEC = "zerokv.aoti.cuda_graph"


def default_compile_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def options_to_specs(options):
    check_option_names("aoti", options, ("compile_device", "cuda_graph"))
    device = options.get("compile_device", default_compile_device())
    if device not in ("cpu", "cuda"):
        raise ZeroKVError(f"engine_options['compile_device']: {device!r}; expected 'cpu' or 'cuda'")
    cuda_graph = options.get("cuda_graph", False)
    if not isinstance(cuda_graph, bool):
        raise ZeroKVError(f"engine_options['cuda_graph']: {cuda_graph!r}; expected True or False")
    if cuda_graph and device != "cuda":
        raise ZeroKVError("engine_options['cuda_graph']: CUDA graphs need compile_device 'cuda', "
                          f"not {device!r}")
    return [CompileSpec(COMPILE_DEVICE_SPEC, device.encode()), CompileSpec(CUDA_GRAPH_SPEC, b"1" if cuda_graph else b"0")]


def options_from_specs(compile_specs):
    return {"compile_device": specs.read(compile_specs, COMPILE_DEVICE_SPEC, default_compile_device()),
            "cuda_graph": specs.read(compile_specs, CUDA_GRAPH_SPEC, "0") == "1"}


def build(program, aliased_inputs, device: str, compile_device: str, cuda_graph: bool):
    examples = []
    for node in program.graph.find_nodes(op="placeholder"):
        if node.name in program.graph_signature.user_inputs:
            value = node.meta["val"]
            shape = [int(extent.node.hint) if isinstance(extent, torch.SymInt) else int(extent) for extent in value.shape]
            examples.append(torch.zeros(shape, dtype=value.dtype))
    target = f"cuda:{specs.parse_device(device)}" if compile_device == "cuda" else "cpu"
    return compile_aoti(program, examples, target, binding_device=blob.Device.CUDA, cuda_graph=cuda_graph)
