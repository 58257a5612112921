"""The AOTInductor engine kind: zerokv.aoti's compile, as an engine build for the blob.

The package is compiled for `compile_device` ("cuda" on a GPU machine; "cpu" on the CPU machines,
where delegates tagged cuda:N run over a host-memory device allocator in tests). The bindings are
CUDA either way: that is where ExecuTorch plans the delegate's I/O.

`cuda_graph` (CUDA packages only) has the runtime capture each run of the package as a CUDA graph
and replay it while the bound addresses and shapes stay the same (cc/engines/aoti): a decode step
is then one graph launch instead of a launch per kernel.

`coordinate_descent_tuning` (CUDA packages only) compiles with Inductor's coordinate-descent tuning:
a one-token matrix product becomes a Triton reduction, fused with its neighbours and tuned to stream
the weights at the memory bandwidth, which the default one-token GEMMs fall well short of. It makes
the compile slower (every kernel is benchmarked while tuning).
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
COORDINATE_DESCENT_TUNING_SPEC = "zerokv.aoti.coordinate_descent_tuning"
CUDA_ONLY_OPTIONS = {"cuda_graph": ("CUDA graphs", CUDA_GRAPH_SPEC),
                     "coordinate_descent_tuning": ("coordinate-descent tuning of Triton kernels",
                                                   COORDINATE_DESCENT_TUNING_SPEC)}


def default_compile_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def options_to_specs(options):
    check_option_names("aoti", options, ("compile_device", *CUDA_ONLY_OPTIONS))
    device = options.get("compile_device", default_compile_device())
    if device not in ("cpu", "cuda"):
        raise ZeroKVError(f"engine_options['compile_device']: {device!r}; expected 'cpu' or 'cuda'")
    compile_specs = [CompileSpec(COMPILE_DEVICE_SPEC, device.encode())]
    for name, (what, spec) in CUDA_ONLY_OPTIONS.items():
        value = options.get(name, False)
        if not isinstance(value, bool):
            raise ZeroKVError(f"engine_options[{name!r}]: {value!r}; expected True or False")
        if value and device != "cuda":
            raise ZeroKVError(f"engine_options[{name!r}] asks for {what}, which need compile_device 'cuda', "
                              f"not {device!r}")
        compile_specs.append(CompileSpec(spec, b"1" if value else b"0"))
    return compile_specs


def options_from_specs(compile_specs):
    options = {"compile_device": specs.read(compile_specs, COMPILE_DEVICE_SPEC, default_compile_device())}
    for name, (_, spec) in CUDA_ONLY_OPTIONS.items():
        options[name] = specs.read(compile_specs, spec, "0") == "1"
    return options


def build(program, aliased_inputs, device: str, compile_device: str, cuda_graph: bool,
          coordinate_descent_tuning: bool):
    examples = []
    for node in program.graph.find_nodes(op="placeholder"):
        if node.name in program.graph_signature.user_inputs:
            value = node.meta["val"]
            shape = [int(extent.node.hint) if isinstance(extent, torch.SymInt) else int(extent) for extent in value.shape]
            examples.append(torch.zeros(shape, dtype=value.dtype))
    target = f"cuda:{specs.parse_device(device)}" if compile_device == "cuda" else "cpu"
    return compile_aoti(program, examples, target, binding_device=blob.Device.CUDA, cuda_graph=cuda_graph,
                        coordinate_descent_tuning=coordinate_descent_tuning)
