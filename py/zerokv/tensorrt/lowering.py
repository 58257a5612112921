"""Lowers a torch.export'ed decoder to a TensorRT plan whose KV caches update in place.

The entry point is `lower_to_tensorrt` (or `build_network` followed by
`TensorRTNetwork.build`, to inspect the network first). The result carries
everything a delegate needs besides the plan: the engine's I/O bindings in
order, which outputs alias which inputs, and every fallback taken with its reason.

Naming: a user input keeps its placeholder name; a caller-owned cache (a mutated
buffer, or a mutated user input) is named after its buffer/input target, and its
written value is the output `<target>.updated`; user outputs are `output_<i>`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection, Mapping, Sequence

import torch
from torch import fx
from torch.export.graph_signature import InputKind, OutputKind

from zerokv.errors import ZeroKVError
from zerokv.kvwrite import analyze_kv_write, exported_program_constants, is_kv_write, op_overload
from zerokv.kvwrite.folding import fold_constants as fold_graph_constants
from zerokv.tensorrt import converters as _converters
from zerokv.tensorrt.kv_cache import KV_CACHE_UPDATE, KVWriteOutcome, convert_kv_write
from zerokv.tensorrt.network import ConversionError, NetworkContext, torch_dtype, trt_dtype
from zerokv.tensorrt.profiles import Profile, ProfileError, ResolvedProfile, resolve_profiles
from zerokv.tensorrt.trt_module import flavor, import_tensorrt


class AliasingPromiseError(ZeroKVError, RuntimeError):
    """A cache promised to be updated in place was not; its update would be lost."""


class PlanBuildError(ZeroKVError, RuntimeError):
    """TensorRT refused to build the network; the message carries its errors."""


@dataclasses.dataclass(frozen=True)
class DynamicDim:
    """A dynamic extent of a binding: the smallest and largest over all profiles."""

    min: int
    max: int


@dataclasses.dataclass(frozen=True)
class IOBinding:
    """One engine I/O tensor.

    `role` is "user_input", "kv_cache" (a caller-owned cache), "user_output" or
    "cache_update" (the written value of a kv_cache); `target` is the buffer or
    input a kv_cache / cache_update belongs to.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int | DynamicDim, ...]
    is_input: bool
    role: str
    target: str | None = None


@dataclasses.dataclass(frozen=True)
class AliasedIO:
    """`output` is written through `input`'s memory; `kind` says by what."""

    output: str
    input: str
    kind: str = KV_CACHE_UPDATE

    def as_tuple(self) -> tuple[str, str, str]:
        return (self.output, self.input, self.kind)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A write (or other node) lowered the slow way, and why."""

    node: str
    target: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class LoweredEngine:
    """A built TensorRT plan and what a runtime needs to bind it."""

    serialized_plan: bytes
    io_bindings: tuple[IOBinding, ...]
    aliased_io: tuple[AliasedIO, ...]
    fallbacks: tuple[Fallback, ...]
    profiles: tuple[ResolvedProfile, ...]
    layer_type_counts: Mapping[str, int]
    tensorrt_flavor: str


@dataclasses.dataclass
class TensorRTNetwork:
    """A network built from an exported program, before the plan is built.

    `network` is the live INetworkDefinition, for inspection; `build()` turns it
    into a LoweredEngine.
    """

    builder: object
    network: object
    config: object
    io_bindings: tuple[IOBinding, ...]
    aliased_io: tuple[AliasedIO, ...]
    fallbacks: tuple[Fallback, ...]
    profiles: tuple[ResolvedProfile, ...]
    kv_writes: tuple[KVWriteOutcome, ...]
    _logger: object
    # Holds the host memory of constant weights, which TensorRT reads at build time.
    _context: NetworkContext

    def layer_type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for index in range(self.network.num_layers):
            name = str(self.network.get_layer(index).type).rsplit(".", 1)[-1]
            counts[name] = counts.get(name, 0) + 1
        return counts

    def build(self) -> LoweredEngine:
        """Builds the plan; raises PlanBuildError with TensorRT's errors if it fails."""
        self._logger.errors.clear()
        plan = self.builder.build_serialized_network(self.network, self.config)
        if plan is None:
            raise PlanBuildError(
                "TensorRT could not build the network: " + ("; ".join(self._logger.errors) or "no error logged")
            )
        return LoweredEngine(
            serialized_plan=bytes(plan),
            io_bindings=self.io_bindings,
            aliased_io=self.aliased_io,
            fallbacks=self.fallbacks,
            profiles=self.profiles,
            layer_type_counts=self.layer_type_counts(),
            tensorrt_flavor=flavor(),
        )


def lower_to_tensorrt(
    program: torch.export.ExportedProgram,
    profiles: Sequence[Profile] = (),
    *,
    promised_aliases: Collection[str] = (),
    fold_constants: bool = False,
    builder_optimization_level: int | None = None,
) -> LoweredEngine:
    """Lowers `program` to a TensorRT plan; see `build_network` for the arguments."""
    return build_network(
        program,
        profiles,
        promised_aliases=promised_aliases,
        fold_constants=fold_constants,
        builder_optimization_level=builder_optimization_level,
    ).build()


def build_network(
    program: torch.export.ExportedProgram,
    profiles: Sequence[Profile] = (),
    *,
    promised_aliases: Collection[str] = (),
    fold_constants: bool = False,
    builder_optimization_level: int | None = None,
) -> TensorRTNetwork:
    """Builds the TensorRT network of `program` with its profiles, ready to build a plan.

    Args:
      program: a torch.export program; in-place ops are functionalised first.
        Mutated buffers and mutated user inputs become caller-owned cache inputs.
      profiles: optimization profiles (see profiles.py); none means one profile
        spanning the export's ranges when anything is dynamic.
      promised_aliases: buffer/input targets whose write-back a caller has already
        dropped on the promise of an in-place update (see `kv_write_alias_decline`).
        If any of them is not aliased in the network, this raises
        AliasingPromiseError rather than returning an engine that loses its update.
      fold_constants: fold compile-time subgraphs (constructors included) first.
      builder_optimization_level: TensorRT's builder optimization level, if not default.

    Raises:
      ConversionError: a node has no converter or cannot be converted; names it.
      ProfileError: a profile does not fit the program.
      AliasingPromiseError: a promised in-place update ended up a copy.
    """
    trt = import_tensorrt()
    program = _functional(program)
    graph_module = program.graph_module
    if fold_constants:
        graph_module = copy.deepcopy(graph_module)
        fold_graph_constants(graph_module)
    signature = _Signature(program)

    logger = _error_collecting_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    ctx = NetworkContext(network)
    constant_lookup = exported_program_constants(program)

    for node in graph_module.graph.find_nodes(op="placeholder"):
        ctx.current_node = node
        ctx.values[node] = _placeholder_value(ctx, node, signature, program)

    kv_outcomes: dict[fx.Node, KVWriteOutcome] = {}
    written_back = _written_back_values(graph_module, signature)
    for node in graph_module.graph.nodes:
        if node.op not in ("call_function", "get_attr"):
            continue
        ctx.current_node = node
        if node.op == "get_attr":
            ctx.values[node] = ctx.constant(getattr(graph_module, node.target))
        elif is_kv_write(node):
            analysis = analyze_kv_write(node, constants=constant_lookup)
            written, outcome = convert_kv_write(
                ctx, analysis, signature.cache_input_names, written_back=node in written_back
            )
            ctx.values[node] = written
            kv_outcomes[node] = outcome
        else:
            ctx.values[node] = _convert(ctx, node)
    ctx.current_node = None

    io_outputs, aliased_io, fallbacks = _mark_outputs(ctx, graph_module, signature, kv_outcomes)
    _check_promises(promised_aliases, signature, aliased_io, kv_outcomes)
    _verify_aliasing(network, aliased_io)

    config = builder.create_builder_config()
    if builder_optimization_level is not None:
        config.builder_optimization_level = builder_optimization_level
    resolved = resolve_profiles(
        profiles,
        user_inputs=signature.user_input_values,
        network_inputs={name: value for name, value, _, _ in signature.network_inputs},
        range_constraints=program.range_constraints,
    )
    for profile in resolved:
        optimization_profile = builder.create_optimization_profile()
        for name, (minimum, optimum, maximum) in profile.shapes.items():
            optimization_profile.set_shape(name, minimum, optimum, maximum)
        config.add_optimization_profile(optimization_profile)

    io_inputs = tuple(
        IOBinding(name, value.dtype, _binding_shape(value, resolved), True, role, target)
        for name, value, role, target in signature.network_inputs
    )
    io_outputs = tuple(
        dataclasses.replace(binding, shape=_binding_shape(value, resolved))
        for binding, value in io_outputs
    )
    return TensorRTNetwork(
        builder=builder,
        network=network,
        config=config,
        io_bindings=io_inputs + io_outputs,
        aliased_io=tuple(aliased_io),
        fallbacks=tuple(fallbacks),
        profiles=tuple(resolved),
        kv_writes=tuple(kv_outcomes.values()),
        _logger=logger,
        _context=ctx,
    )


# ----- Internals -----------------------------------------------------------------


class _Signature:
    """The exported program's inputs and outputs, as the network sees them."""

    def __init__(self, program: torch.export.ExportedProgram):
        specs = program.graph_signature
        mutated_buffers = {
            spec.target for spec in specs.output_specs if spec.kind == OutputKind.BUFFER_MUTATION
        }
        mutated_user_inputs = {
            spec.target for spec in specs.output_specs if spec.kind == OutputKind.USER_INPUT_MUTATION
        }
        self.input_kinds: dict[str, tuple[InputKind, str | None]] = {}
        # placeholder name -> network input name, for caches the caller owns.
        self.cache_input_names: dict[str, str] = {}
        # placeholder name -> buffer or input target, for the same caches.
        self.cache_targets: dict[str, str] = {}
        self.user_input_values: dict[str, torch.Tensor] = {}
        self.network_inputs: list[tuple[str, torch.Tensor, str, str | None]] = []
        for spec in specs.input_specs:
            name = spec.arg.name
            self.input_kinds[name] = (spec.kind, spec.target)
            is_mutated_buffer = spec.kind == InputKind.BUFFER and spec.target in mutated_buffers
            is_mutated_input = spec.kind == InputKind.USER_INPUT and name in mutated_user_inputs
            if is_mutated_buffer or is_mutated_input:
                target = spec.target if is_mutated_buffer else name
                self.cache_input_names[name] = target
                self.cache_targets[name] = target
        placeholders = {n.name: n for n in program.graph.find_nodes(op="placeholder")}
        for spec in specs.input_specs:
            name = spec.arg.name
            value = placeholders[name].meta.get("val")
            if name in self.cache_input_names:
                self.network_inputs.append((self.cache_input_names[name], value, "kv_cache", self.cache_targets[name]))
            elif spec.kind == InputKind.USER_INPUT and isinstance(value, torch.Tensor):
                self.user_input_values[name] = value
                self.network_inputs.append((name, value, "user_input", None))
        self.output_specs = list(specs.output_specs)


def _functional(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` without in-place ops, so cache writes are values with a signature entry."""
    mutates = any(
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
        for node in program.graph.nodes
    )
    return program.run_decompositions({}) if mutates else program


def _placeholder_value(ctx: NetworkContext, node: fx.Node, signature: _Signature, program):
    kind, target = signature.input_kinds[node.name]
    value = node.meta.get("val")
    if kind == InputKind.USER_INPUT and isinstance(value, (int, float, bool)):
        # torch.export specialised this scalar: the graph already holds its value.
        if node.users:
            raise ConversionError(node, "a scalar user input that the graph reads is not supported")
        return value
    if node.name in signature.cache_input_names or kind == InputKind.USER_INPUT:
        if not isinstance(value, torch.Tensor):
            raise ConversionError(node, f"input of type {type(value).__name__} is not supported; only tensors")
        name = signature.cache_input_names.get(node.name, node.name)
        shape = tuple(extent if isinstance(extent, int) else -1 for extent in value.shape)
        return ctx.network.add_input(name, trt_dtype(value.dtype), shape)
    if kind in (InputKind.PARAMETER, InputKind.BUFFER):
        weights = program.state_dict.get(target)
        if weights is None:
            weights = program.constants.get(target)
    elif kind == InputKind.CONSTANT_TENSOR:
        weights = program.constants.get(target)
    else:
        raise ConversionError(node, f"input kind {kind.name} is not supported")
    if not isinstance(weights, torch.Tensor):
        raise ConversionError(node, f"no value found for {kind.name.lower()} '{target}'")
    return ctx.constant(weights)


def _convert(ctx: NetworkContext, node: fx.Node):
    converter = _converters.CONVERTERS.get(op_overload(node.target))
    if converter is None:
        raise ConversionError(node, "has no TensorRT converter")
    value = converter(ctx, node)
    expected = node.meta.get("val")
    if isinstance(expected, torch.Tensor) and value is not None and hasattr(value, "dtype"):
        # Keep the network's dtypes in lockstep with torch's, whatever a converter did.
        value = ctx.cast(value, expected.dtype)
    return value


def _mark_outputs(ctx, graph_module, signature: _Signature, kv_outcomes):
    output_node = graph_module.graph.output_node()
    values = output_node.args[0]
    bindings, aliased, fallbacks = [], [], []
    by_node = dict(kv_outcomes)
    for outcome in kv_outcomes.values():
        if not outcome.aliased:
            fallbacks.append(Fallback(outcome.node_name, signature.cache_targets.get(outcome.cache_name), outcome.fallback_reason))
    user_output_index = 0
    for spec, value in zip(signature.output_specs, values):
        ctx.current_node = value if isinstance(value, fx.Node) else None
        if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
            # The partitioner cut the graph where a size flows to a node the engine does not take
            # (typically an op without a converter): a network output must be a tensor.
            raise ConversionError(
                ctx.current_node, f"output {value} is a symbolic size, not a tensor: a node outside the delegate "
                "uses a size computed inside it (is an op it feeds missing a TensorRT converter?)")
        tensor = ctx.tensor(value)
        if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
            placeholder = _placeholder_of(signature, spec)
            target = signature.cache_targets[placeholder]
            name = f"{target}.updated"
            outcome = by_node.get(value)
            if outcome is not None and outcome.aliased and outcome.cache_name == placeholder:
                aliased.append(AliasedIO(name, outcome.aliased_input, KV_CACHE_UPDATE))
            role = "cache_update"
        elif spec.kind == OutputKind.USER_OUTPUT:
            name, target, role = f"output_{user_output_index}", None, "user_output"
            user_output_index += 1
        else:
            raise ConversionError(ctx.current_node, f"output kind {spec.kind.name} is not supported")
        if tensor.is_network_input or tensor.is_network_output:
            # An output must be its own tensor: an input passed through, or one
            # value returned twice, gets an identity layer.
            identity = ctx.network.add_identity(tensor)
            ctx.name(identity, "output")
            tensor = identity.get_output(0)
        tensor.name = name
        ctx.network.mark_output(tensor)
        bindings.append((IOBinding(name, torch_dtype(tensor.dtype), (), False, role, target), value.meta["val"]))
    ctx.current_node = None
    return bindings, aliased, fallbacks


def _written_back_values(graph_module, signature: _Signature) -> set[fx.Node]:
    """The nodes whose values the program writes back to a caller-owned cache."""
    values = graph_module.graph.output_node().args[0]
    return {
        value
        for spec, value in zip(signature.output_specs, values)
        if spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)
    }


def _placeholder_of(signature: _Signature, spec) -> str:
    for placeholder, target in signature.cache_targets.items():
        if target == spec.target:
            return placeholder
    raise ValueError(f"mutated '{spec.target}' is not a caller-owned input")


def _check_promises(promised, signature: _Signature, aliased_io, kv_outcomes):
    aliased_targets = {
        signature.cache_targets[placeholder]
        for placeholder, input_name in signature.cache_input_names.items()
        if any(a.input == input_name for a in aliased_io)
    }
    known = set(signature.cache_targets.values())
    for target in promised:
        if target not in known:
            raise AliasingPromiseError(f"'{target}' was promised an in-place update but is not a mutated cache")
        if target in aliased_targets:
            continue
        reasons = [
            o.fallback_reason
            for o in kv_outcomes.values()
            if signature.cache_targets.get(o.cache_name) == target and o.fallback_reason
        ]
        raise AliasingPromiseError(
            f"cache '{target}' was promised an in-place update, but the engine writes a copy "
            f"({'; '.join(reasons) or 'its written value is not a KV-cache-update output'}); "
            "its write-back must not be dropped"
        )


def _verify_aliasing(network, aliased_io):
    """Re-reads every alias off the network itself, so a bookkeeping slip cannot ship."""
    trt = import_tensorrt()
    producers = {}
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        for output in range(layer.num_outputs):
            producers[layer.get_output(output).name] = layer
    for alias in aliased_io:
        layer = producers.get(alias.output)
        if layer is not None and layer.type == trt.LayerType.IDENTITY:
            layer = producers.get(layer.get_input(0).name)
        if layer is None or layer.type != trt.LayerType.KV_CACHE_UPDATE:
            raise AliasingPromiseError(f"output '{alias.output}' is not written by a KV-cache-update layer")
        cache = layer.get_input(0)
        if not cache.is_network_input or cache.name != alias.input:
            raise AliasingPromiseError(
                f"output '{alias.output}' updates '{cache.name}', not the network input '{alias.input}'"
            )


def _binding_shape(value: torch.Tensor, resolved: Sequence[ResolvedProfile]):
    """Static extents as ints; symbolic ones as their bounds over all profiles."""
    return tuple(
        extent
        if isinstance(extent, int)
        else DynamicDim(
            min(profile.evaluate(extent, "min") for profile in resolved),
            max(profile.evaluate(extent, "max") for profile in resolved),
        )
        for extent in value.shape
    )


def _error_collecting_logger(trt):
    """A TensorRT logger that keeps errors for the exception a failed build raises."""

    class ErrorCollectingLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, message):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(message)

    return ErrorCollectingLogger()
