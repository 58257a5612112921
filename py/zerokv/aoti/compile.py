"""compile_aoti: an exported partition -> an AOTInductor package plus its zerokv binding table.

How a mutated input is represented. A cache the partition updates is a *user input* the graph
mutates in place (`k_cache.index_copy_(2, pos, x)`); AOTInductor compiles that to a kernel that
stores into the input's own buffer, so the C++ engine, which wraps the caller's pointer with
`at::from_blob`, updates the caller's cache with no copy. The engine does not return the updated
cache. In the binding table the update is an OUTPUT binding named `<input>_out` that aliases the
input (AliasedIO kind KV_CACHE_UPDATE); it is the aliased output that the blob may record as elided.

The program's graph mutates the input (torch.export records USER_INPUT_MUTATION once
functionalized): the natural export of a decode step, and what zerokv.executorch's engine_program
makes of a delegate whose caches were promised in-place writes.

Engine binding order: inputs in the graph's placeholder order, then the aliased outputs (in the
order torch.export lists the mutations), then the returned outputs. The same table goes into the
package's AOTInductor metadata (zerokv.bindings / zerokv.aliases / zerokv.device), which the C++
engine reports back so the runtime can check the blob against it. AOTInductor writes that metadata
into Inductor's cache, shared by every compile of the program on the machine, so compile_aoti reads
the finished package back and refuses one that holds another compile's
(check_packaged_metadata).

Weights. The package holds the compiled code only (aot_inductor.package_constants_in_so=False): each
constant AOTInductor keeps (its weights, by fully qualified name) becomes a blob.Constant whose
storage goes to ExecuTorch's named data under a key that is its content's hash, so that delegates
sharing a weight (prefill and decode) share one entry. The C++ engine hands the mapped bytes to
the package (AOTIModelPackageLoader::load_constants, user-managed): no weight is copied into the
package, the blob or a temporary file.

Combined launches. A CUDA package is compiled with Inductor's combo kernels: kernels that do not
depend on one another run as one launch, each in its own range of programs. In a decoder's step
the query's rotary embedding, the key's with its cache write and the value's cache write are one
kernel a layer instead of three, each of which waited on memory for the one before it: on the H200
the 1B step's bare engine was 2.6-4.4% faster, in two A/Bs on two machines
(tools/bench/results/h200/combo_kernels_ab_9205014.md).

One-token products. zerokv::matvec calls that read the same input (a decoder's query, key and
value projections) are handed to AOTInductor as one zerokv::matvec_siblings launch
(zerokv.kernels.sibling_matvecs): the same values, in fewer launches.

Early launch. A CUDA package compiled on sm_90 or later names, in zerokv.dependent_launch_kernels,
the kernels that wait for the kernel before them (zerokv.kernels.dependent_launch): zerokv's, and
Inductor's pointwise and reduction kernels, which it compiles with Inductor's PDL code (they signal
once they have read their inputs); the engine lets those launch before that kernel ends. The
products whose weights are the program's constants load their first tile before that wait
(zerokv.kernels.constant_weights marks them). Kernels keep their own names in the package
(Inductor's unique user kernel names off), which is what the engine matches.
"""

import dataclasses
import functools
import hashlib
import io
import json
import os
import tempfile
import zipfile
from typing import Optional, Sequence, Union

import torch
from torch._inductor.package import package_aoti
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.export.passes import move_to_device_pass  # torch 2.11 does not import it with torch.export
from torch.export.pt2_archive._package_weights import Weights

from zerokv import blob
from zerokv.aoti.inductor_kernels import kernel_analysis_failures, kernel_sources_recorded
from zerokv.aoti.int_array_declarations import declarations_where_used
from zerokv.blob.torch_dtypes import BLOB_DTYPES
from zerokv.errors import ZeroKVError
from zerokv.kernels import dependent_launch
from zerokv.kernels.constant_weights import mark_constant_weights
from zerokv.kernels.sibling_matvecs import group_sibling_matvecs


class AotiCompileError(ZeroKVError, ValueError):
    """The partition cannot be compiled into a zerokv AOTInductor engine; the message names the input
    or output at fault and what to change."""


# The package's metadata entry that names the kernels that may launch early (the engine's
# ReadDependentLaunch reads it).
EARLY_KERNELS_KEY = "zerokv.dependent_launch_kernels"

# Named data entries are aligned for the engines' vector loads (AOTInductor aligns constants to 64).
NAMED_DATA_ALIGNMENT = 64


@dataclasses.dataclass
class EngineBuild:
    """What `preprocess` puts in a blob, and what it adds to ExecuTorch's named data."""

    payload: bytes  # the engine code the blob carries; b"" when the engine is named data
    bindings: list
    aliased_io: list
    named_data: dict = dataclasses.field(default_factory=dict)  # key -> bytes the engine reads at init
    engine_key: str = ""  # the named data entry that is the engine (a TensorRT plan)
    constants: list = dataclasses.field(default_factory=list)  # blob.Constant, keys of named_data


def named_data_key(data) -> str:
    """The key of an entry of ExecuTorch's named data: its content's hash, so equal data is one entry."""
    return "zerokv/" + hashlib.sha256(data).hexdigest()


def compile_aoti(
    program: Union[ExportedProgram, torch.nn.Module],
    example_inputs: Sequence[torch.Tensor],
    device: str,
    *,
    binding_device: Optional[blob.Device] = None,
    dynamic_shapes=None,
    cuda_graph: bool = False,
    coordinate_descent_tuning: bool = False,
) -> EngineBuild:
    """Compiles `program` with AOTInductor for `device` ("cpu" or "cuda[:N]").

    binding_device: where the delegate's buffers are planned (the blob's IOBinding.device); CUDA
        for a cuda device, else CPU. A CPU engine serving a delegate tagged target_device=cuda:0
        (planned in device memory) passes blob.Device.CUDA.
    cuda_graph: the runtime captures the package's runs as CUDA graphs and replays them
        (zerokv.cuda_graph in the package's metadata; CUDA packages only).
    coordinate_descent_tuning: Inductor's coordinate-descent tuning (CUDA packages only): one-token
        matrix products become tuned Triton reductions (zerokv.executorch.aoti_engine says why).
    """
    torch_device = torch.device(device)
    if torch_device.type not in ("cpu", "cuda"):
        raise AotiCompileError(f"compile_aoti compiles for 'cpu' or 'cuda', not {device!r}")
    if cuda_graph and torch_device.type != "cuda":
        raise AotiCompileError(f"cuda_graph: CUDA graphs are for CUDA packages, not {device!r}")
    if coordinate_descent_tuning and torch_device.type != "cuda":
        raise AotiCompileError("coordinate_descent_tuning: it tunes Triton kernels, which CUDA packages have, "
                               f"not {device!r} ones")
    example_inputs = tuple(t.to(torch_device) for t in example_inputs)
    if isinstance(program, ExportedProgram):
        if torch_device.type == "cuda":
            program = move_to_device_pass(program, torch_device)
    else:
        program = _export(program.to(torch_device), example_inputs, dynamic_shapes)

    bindings, aliased_io = binding_table(program, binding_device or (
        blob.Device.CUDA if torch_device.type == "cuda" else blob.Device.CPU))
    # zerokv's kernels; Inductor's are named as it defines them (_name_early_kernels).
    metadata = package_metadata(bindings, aliased_io, torch_device, cuda_graph,
                                dependent_launch.early_kernels(torch_device, {}))
    args, kwargs = program.example_inputs
    module = program.module(check_guards=False)
    if group_sibling_matvecs(module.graph) + mark_constant_weights(module.graph):
        module.recompile()
    name_early_kernels = functools.partial(_name_early_kernels, torch_device)
    # AOTInductor writes its files into a folder of this compile's own: in Inductor's cache, which
    # every compile of the same program on the machine shares (a test's shards in parallel), another
    # compile could rewrite them before they are packaged.
    with tempfile.TemporaryDirectory() as directory:
        with (declarations_where_used(), kernel_sources_recorded(name_early_kernels) as inductor_sources,
              kernel_analysis_failures() as unanalyzed):
            files = torch._inductor.aot_compile(
                module,
                args,
                kwargs,
                options={
                    "aot_inductor.package": True,
                    "aot_inductor.output_path": os.path.join(directory, "aotinductor"),
                    "aot_inductor.metadata": metadata,
                    "aot_inductor.package_constants_in_so": False,
                    # Returns the constants AOTInductor keeps, by FQN, instead of writing them anywhere.
                    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
                    **inductor_options(torch_device, coordinate_descent_tuning),
                },
            )
        if unanalyzed:
            raise AotiCompileError(f"Inductor could not tell which arguments a Triton kernel writes ({unanalyzed[0]}), "
                                   "so AOTInductor would copy every argument of it, the weights included, before each "
                                   "launch; change the kernel so that Triton compiles it for that analysis")
        metadata[EARLY_KERNELS_KEY] = ",".join(dependent_launch.early_kernels(torch_device, inductor_sources))
        build = EngineBuild(payload=b"", bindings=bindings, aliased_io=aliased_io)
        for weights in (f for f in files if isinstance(f, Weights)):
            for name, (tensor, _) in weights.items():
                add_constant(build, name, tensor)
        path = os.path.join(directory, "engine.pt2")
        package_aoti(path, [f for f in files if isinstance(f, str)])
        with open(path, "rb") as package:
            build.payload = package.read()
    check_packaged_metadata(build.payload, metadata)
    return build


def inductor_options(device: torch.device, coordinate_descent_tuning: bool) -> dict:
    """How Inductor compiles the kernels of a package for `device` (what compile_aoti adds to where
    AOTInductor writes the package)."""
    return {
        "coordinate_descent_tuning": coordinate_descent_tuning,
        "triton.unique_user_kernel_names": False,
        "triton.enable_pdl": dependent_launch.supported(device),
        "combo_kernels": device.type == "cuda",
    }


def package_metadata(bindings, aliased_io, device: torch.device, cuda_graph: bool,
                     early_kernels: Sequence[str]) -> dict:
    """The package's AOTInductor metadata, which the C++ engine reads back. `early_kernels`: the
    kernels compiled to wait for the kernel before them (zerokv.kernels.dependent_launch), none
    where the compiling device has no such wait."""
    return {
        "zerokv.bindings": ";".join(f"{b.name}:{b.direction.name}:{b.dtype.name}" for b in bindings),
        "zerokv.aliases": ";".join(f"{a.output}={a.input}" for a in aliased_io),
        "zerokv.device": device.type,
        "zerokv.cuda_graph": "1" if cuda_graph else "0",
        EARLY_KERNELS_KEY: ",".join(early_kernels),
    }


def check_packaged_metadata(payload: bytes, metadata: dict) -> None:
    """Raises AotiCompileError unless every metadata file in the package holds `metadata`, but for
    the kernels that may launch early, of which it may name fewer (a package whose Inductor kernels
    launch as captured is slower, not wrong). AOTInductor writes the files into Inductor's cache,
    which every compile of the same program on the machine shares, and the package is made from
    there after AOTInductor's lock is released: a compile of it elsewhere (another engine's
    options, a test's other shard) may have rewritten one meanwhile."""
    with zipfile.ZipFile(io.BytesIO(payload)) as package:
        names = [name for name in package.namelist() if name.endswith("_metadata.json")]
        if not names:
            raise AotiCompileError("the AOTInductor package has no metadata file (*_metadata.json): the engine could "
                                   "not read its binding table")
        for name in names:
            try:
                packaged = json.loads(package.read(name))
            except ValueError as error:
                packaged = {"unreadable": str(error)}
            wrong = sorted(key for key, value in metadata.items() if _differs(key, value, packaged.get(key)))
            if wrong:
                raise AotiCompileError(
                    f"the AOTInductor package's {name} is not this compile's metadata ({', '.join(wrong)} differ"
                    f"{'; ' + packaged['unreadable'] if 'unreadable' in packaged else ''}). AOTInductor wrote it into "
                    "Inductor's cache, which every compile of the same program on this machine shares: another "
                    "compile may have rewritten it before it was packaged. Compile again")


def _differs(key: str, ours: str, packaged) -> bool:
    if key == EARLY_KERNELS_KEY and isinstance(packaged, str):
        return not set(filter(None, packaged.split(","))) <= set(ours.split(","))
    return packaged != ours


def _name_early_kernels(device: torch.device, inductor_sources) -> None:
    """Names, in the metadata of the package being compiled, the kernels that may launch early,
    Inductor's defined so far among them. AOTInductor writes the package's metadata from its
    configuration's, under its lock, once it has defined every kernel: the names are there then.
    Only this compile's configuration is changed (the options are a patch of it)."""
    torch._inductor.config.aot_inductor.metadata[EARLY_KERNELS_KEY] = ",".join(
        dependent_launch.early_kernels(device, inductor_sources))


def add_constant(build, name, tensor):
    """Adds `tensor`'s whole storage to build.named_data and its place in it to build.constants."""
    if tensor.dtype not in BLOB_DTYPES:
        raise AotiCompileError(f"constant {name!r} has dtype {tensor.dtype}, which the blob cannot express")
    storage = tensor.untyped_storage()
    if storage.device.type != "cpu":
        storage = storage.cpu()
    # A uint8 view of the storage; bytes(storage) would copy it one element at a time.
    view = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    key = named_data_key(memoryview(view))
    build.named_data.setdefault(key, view.tobytes())
    build.constants.append(blob.Constant(
        name=name,
        key=key,
        dtype=BLOB_DTYPES[tensor.dtype],
        sizes=list(tensor.shape),
        strides=list(tensor.stride()),
        storage_offset=tensor.storage_offset(),
    ))


def _export(module, example_inputs, dynamic_shapes):
    return torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)


def binding_table(program: ExportedProgram, binding_device: blob.Device):
    """The bindings of `program`'s user inputs, of the writes of its mutated inputs (each aliased to
    its input, as `<input>_out`) and of its outputs, in that order; and the aliased I/O."""
    functional = program.run_decompositions({})
    signature = functional.graph_signature
    for spec in signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            raise AotiCompileError(
                f"the partition mutates buffer {spec.target!r}: a cache the engine owns is not the caller's; "
                "lift it to an input so the engine writes the caller's buffer"
            )
    values = {node.name: node.meta["val"] for node in functional.graph.nodes if "val" in node.meta}
    ranges = functional.range_constraints

    bindings, aliased_io, names = [], [], set()
    user_inputs = [spec for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
    for spec in user_inputs:
        bindings.append(_binding(spec.arg.name, values[spec.arg.name], blob.Direction.INPUT, binding_device, ranges))
        names.add(spec.arg.name)
    outputs = []
    for spec in signature.output_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            name = _unique(f"{spec.target}_out", names)
            outputs.append(_binding(name, values[spec.target], blob.Direction.OUTPUT, binding_device, ranges))
            aliased_io.append(blob.AliasedIO(name, spec.target, blob.AliasKind.KV_CACHE_UPDATE))
    for spec in signature.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            if spec.arg.name in names:
                raise AotiCompileError(f"output {spec.arg.name!r} returns an input unchanged; the engine cannot bind it twice")
            name = _unique(spec.arg.name, names)
            outputs.append(_binding(name, values[spec.arg.name], blob.Direction.OUTPUT, binding_device, ranges))
    return bindings + outputs, aliased_io


def _unique(name, taken):
    candidate, suffix = name, 1
    while candidate in taken:
        candidate, suffix = f"{name}_{suffix}", suffix + 1
    taken.add(candidate)
    return candidate


def _binding(name, value, direction, device, ranges):
    if not isinstance(value, torch.Tensor):
        raise AotiCompileError(f"{direction.name.lower()} {name!r} is not a tensor ({type(value).__name__})")
    if value.dtype not in BLOB_DTYPES:
        raise AotiCompileError(f"{direction.name.lower()} {name!r} has dtype {value.dtype}, which the blob cannot express")
    return blob.IOBinding(name, BLOB_DTYPES[value.dtype], direction, device, [_dim(name, d, ranges) for d in value.shape])


def _dim(name, size, ranges):
    if isinstance(size, int):
        return blob.Dim(size, size)
    expr = size.node.expr
    bounds = ranges.get(expr)
    if bounds is None:
        raise AotiCompileError(f"{name!r} has a derived dynamic dimension {expr}; give it its own Dim with a max")
    lower, upper = bounds.lower, bounds.upper
    if not upper.is_finite:
        raise AotiCompileError(f"{name!r} dimension {expr} has no upper bound; the blob needs one (Dim max)")
    return blob.Dim(int(lower), int(upper))
