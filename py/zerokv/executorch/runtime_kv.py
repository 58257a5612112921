"""Runtime-owned KV caches: storage the zerokv runtime allocates, grows and binds, never the .pte.

The model takes its caches as inputs it writes in place (`k_cache.index_copy_(2, positions, k)`),
with a dynamic positions axis (dim 2) up to the maximum capacity. `export(..., runtime_kv=RuntimeKV(
...))` then:
  1. before partitioning, marks those inputs (RUNTIME_KV on the placeholder). Their mutation
     outputs stay until lowering: they are what keeps a write alive that nothing in the method
     reads afterwards (a prefill attending over its fresh K/V writes the caches for decode only);
  2. in `preprocess`, records them in the blob's KV manifest (not as delegate arguments), with the
     step width source that tells the runtime how many tokens a step writes, and the positions
     input that the runtime fills with the step's positions (a ring layer's slots input too); the
     engine writes the runtime's storage in place and returns nothing for them;
  3. after lowering, removes them from the method's inputs and their writes from the delegate's and
     the method's outputs, so that no caller passes them and no storage for them is planned,
     returned or serialized, and refuses a positions or slots input that anything but the delegate
     owning the caches reads: the runtime's values reach only that one.

The positions a step writes belong to the runtime, which knows what is committed: the caller's
positions argument gives its shape (one element, the first position; or one per token), never its
values. A ring layer's write slots are the runtime's too (position modulo the window, in the
`slots` input its write is indexed by): a model that computes its own slot is refused.
"""

from __future__ import annotations

import dataclasses
import operator
import uuid

import torch
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from zerokv import blob
from zerokv.errors import ZeroKVError
from zerokv.executorch.delegates import RUNTIME_KV, delegate_nodes, is_zerokv_delegate
from zerokv.executorch.engines import aten_target, readers_besides, value_readers, write_backs, written_back
from zerokv.kvwrite import is_kv_write

POSITIONS_DIM = 2


class RuntimeKVError(ZeroKVError, ValueError):
    """A runtime_kv declaration does not fit the program; the message names the input and method."""


@dataclasses.dataclass(frozen=True)
class KVCacheLayer:
    """One layer's runtime-owned K and V caches, named by the method inputs that hold them."""

    k_input: str
    v_input: str
    max_capacity: int
    initial_capacity: int = 16
    policy: str = "flat"  # "flat" (grows by doubling up to max_capacity) or "ring"
    window: int = 0  # ring only: the positions kept
    # Ring only: the method input (int64, one per token) that indexes the layer's writes, which the
    # runtime fills with (position + i) mod window.
    slots: str = ""

    def __post_init__(self):
        if self.policy not in ("flat", "ring"):
            raise RuntimeKVError(f"layer {self.k_input}/{self.v_input}: policy {self.policy!r} is not 'flat' or 'ring'")
        name = f"layer {self.k_input}/{self.v_input}"
        if self.policy == "ring" and self.window <= 0:
            raise RuntimeKVError(f"{name}: a ring cache needs a window")
        if self.policy == "ring" and self.window > self.max_capacity:
            raise RuntimeKVError(f"{name}: window {self.window} exceeds max_capacity {self.max_capacity}")
        if self.policy == "ring" and not self.slots:
            raise RuntimeKVError(f"{name}: a ring cache needs `slots`, the input its writes are indexed by "
                                 "(the runtime computes the slots: position modulo the window)")
        if self.policy == "flat" and self.slots:
            raise RuntimeKVError(f"{name}: `slots` ({self.slots!r}) is for ring caches")
        if not 0 < self.initial_capacity <= self.max_capacity:
            raise RuntimeKVError(
                f"{name}: needs 0 < initial_capacity ({self.initial_capacity}) <= max_capacity ({self.max_capacity})")


@dataclasses.dataclass(frozen=True)
class RuntimeKV:
    """The runtime-owned caches of a program, where the runtime reads a step's width, and the input
    it fills with the step's positions.

    step_width: (method input name, dim) whose extent is the number of tokens a step writes, e.g.
    ("tokens", 1). The runtime reads that extent (shape metadata only) before each execute.
    positions: the method input (int32 or int64) the model takes the step's positions from, e.g.
    "position" (one element: the first) or "cache_position" (one per token; it may also be the
    step width source, ("cache_position", 0)). The runtime fills it with the positions that follow
    the committed ones, whatever the caller passed; only the delegate that owns the caches may read
    it (its rotary embeddings and masks included).
    """

    layers: tuple
    step_width: tuple
    positions: str

    def storage_keys(self):
        """Keys shared by every method of one export, and by no other export."""
        nonce = uuid.uuid4().hex[:12]
        return {layer: f"{nonce}/{layer.k_input}+{layer.v_input}" for layer in self.layers}


@dataclasses.dataclass(frozen=True)
class RuntimeKVBinding:
    """What a marked placeholder carries into `preprocess`."""

    role: str  # "k" or "v"
    layer: KVCacheLayer
    storage_key: str
    runtime_kv: RuntimeKV


def mark_runtime_kv(program, runtime_kv: RuntimeKV, storage_keys, method: str):
    """Marks the cache inputs of `program` (functional, before partitioning)."""
    signature = program.graph_signature
    placeholders = {node.name: node for node in program.graph.find_nodes(op="placeholder")}
    user_inputs = {spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT}
    if runtime_kv.step_width[0] not in user_inputs:
        raise RuntimeKVError(f"method '{method}': step width input '{runtime_kv.step_width[0]}' is not an input")
    _check_index_input(placeholders, user_inputs, runtime_kv.positions, "positions", method)
    mutated = {spec.target: index for index, spec in enumerate(signature.output_specs)
               if spec.kind == OutputKind.USER_INPUT_MUTATION}
    values = list(program.graph.output_node().args[0])
    for layer in runtime_kv.layers:
        for role, name in (("k", layer.k_input), ("v", layer.v_input)):
            if name not in user_inputs:
                raise RuntimeKVError(f"method '{method}': runtime KV cache '{name}' is not an input of the method")
            if name not in mutated:
                raise RuntimeKVError(f"method '{method}': runtime KV cache '{name}' is never written")
            write = values[mutated[name]]
            cache = placeholders[name]
            if not is_kv_write(write) or write.args[0] is not cache or readers_besides(cache, write):
                raise RuntimeKVError(
                    f"method '{method}': runtime KV cache '{name}' must be written once by a KV write "
                    "(index_copy, index_put, slice_scatter) and read only through it or by a reader of the rows "
                    "before the ones it writes")
            if layer.policy == "ring":
                _check_ring_write(write, placeholders, user_inputs, layer, runtime_kv, name, method)
            extent = cache.meta["val"].shape[POSITIONS_DIM]
            if not isinstance(extent, torch.SymInt):
                raise RuntimeKVError(
                    f"method '{method}': runtime KV cache '{name}' has a static positions axis ({extent}); "
                    "export it with a dynamic dim 2 up to max_capacity so the runtime can grow it")
            cache.meta[RUNTIME_KV] = RuntimeKVBinding(role, layer, storage_keys[layer], runtime_kv)


def _check_index_input(placeholders, user_inputs, name, what, method):
    """An input the runtime fills with positions: a method input of an integer dtype."""
    if name not in user_inputs:
        raise RuntimeKVError(f"method '{method}': {what} input '{name}' is not an input of the method")
    dtype = placeholders[name].meta["val"].dtype
    if dtype not in (torch.int32, torch.int64):
        raise RuntimeKVError(f"method '{method}': {what} input '{name}' is {dtype}; the runtime fills it with "
                             "positions, so it must be int32 or int64")


def _write_index(write):
    """The node a KV write takes its positions-axis index from, or None (a slice_scatter's bounds)."""
    target = aten_target(write)
    if target is torch.ops.aten.index_copy.default and write.args[1] == POSITIONS_DIM:
        return write.args[2]
    if target is torch.ops.aten.index_put.default:
        indices = list(write.args[1])
        if len(indices) > POSITIONS_DIM and all(index is None for index in indices[:POSITIONS_DIM]):
            return indices[POSITIONS_DIM]
    return None


def _check_ring_write(write, placeholders, user_inputs, layer, runtime_kv, name, method):
    """A ring cache is written at the slots the runtime computes, never at slots of the model's."""
    _check_index_input(placeholders, user_inputs, layer.slots, "slots", method)
    if layer.slots == runtime_kv.positions:
        raise RuntimeKVError(f"method '{method}': ring cache '{name}' is indexed by the positions input "
                             f"'{layer.slots}'; its slots must be an input of their own")
    if _write_index(write) is not placeholders[layer.slots]:
        raise RuntimeKVError(
            f"method '{method}': ring cache '{name}' is not written at its slots input '{layer.slots}' (an "
            "index_copy or index_put along dim 2 indexed by that input itself): the runtime computes a "
            "ring's slots, position modulo the window, and the model must not compute its own")


def detach_runtime_kv(program, method: str):
    """After lowering: removes the marked caches from the method: their writes from the delegate's
    and the method's outputs, then the caches from the inputs (the delegate binds them)."""
    graph = program.graph
    marked = [node for node in graph.find_nodes(op="placeholder") if RUNTIME_KV in node.meta]
    if not marked:
        return
    names = {cache.name for cache in marked}
    _detach_writes(program, names, method)
    owners = set()
    for node, lowered in delegate_nodes(program.graph_module):
        owned = [index for index, arg in enumerate(node.args[1:]) if arg in marked]
        if owned:
            owners.add(node)
            _bind_inside(lowered.original_module, owned)
            node.args = tuple(arg for arg in node.args if arg not in marked)
    _refuse_other_readers_of_positions(graph, marked, owners, method)
    for cache in marked:
        if cache.users:
            raise RuntimeKVError(
                f"method '{method}': runtime KV cache '{cache.name}' is read outside the delegate that owns it "
                f"(by {', '.join(user.name for user in cache.users)})")
        graph.erase_node(cache)
    signature = program.graph_signature
    signature.input_specs[:] = [spec for spec in signature.input_specs
                                if not (spec.kind == InputKind.USER_INPUT and spec.arg.name in names)]
    remaining = sum(1 for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT)
    call = program.module_call_graph[0].signature
    call.inputs[:] = [arg for arg in call.inputs if getattr(arg, "name", None) not in names]
    call.in_spec = pytree.tree_structure((tuple(range(remaining)), {}))
    program.graph_module.recompile()


def _detach_writes(program, names, method: str):
    """Drops the method outputs that are the marked caches' mutations, and the delegate outputs
    that carried them: the engine wrote the runtime's storage in place."""
    delegates = dict(delegate_nodes(program.graph_module))
    placeholders = {node.name: node for node in program.graph.find_nodes(op="placeholder")}
    output_node = program.graph.output_node()
    values = list(output_node.args[0])
    specs = program.graph_signature.output_specs
    dropped, carried, copies = set(), {}, []
    for index, spec in enumerate(specs):
        if spec.kind != OutputKind.USER_INPUT_MUTATION or spec.target not in names:
            continue
        returned = values[index]
        value = written_back(returned, placeholders[spec.target])
        call = value.args[0] if value.op == "call_function" and value.target is operator.getitem else None
        if call not in delegates or not is_zerokv_delegate(delegates[call]):
            raise RuntimeKVError(
                f"method '{method}': the write of runtime KV cache '{spec.target}' is not inside a zerokv "
                f"delegate ({value.name}); the runtime's storage can only be written by its engine")
        chain = write_backs(returned, placeholders[spec.target])
        reader = chain[-1] if chain else output_node
        if set(value.users) != {reader}:
            raise RuntimeKVError(
                f"method '{method}': the updated runtime KV cache '{spec.target}' is read outside the delegate "
                f"that writes it (by {', '.join(user.name for user in value.users if user is not reader)})")
        dropped.add(index)
        carried.setdefault(call, []).append(value)
        copies += chain
    output_node.args = (tuple(value for index, value in enumerate(values) if index not in dropped),)
    specs[:] = [spec for index, spec in enumerate(specs) if index not in dropped]
    for copy in copies:
        program.graph.erase_node(copy)
    for call, getitems in carried.items():
        positions = sorted((getitem.args[1] for getitem in getitems), reverse=True)
        for getitem in getitems:
            program.graph.erase_node(getitem)
        _drop_delegate_outputs(call, delegates[call], positions)


def _drop_delegate_outputs(call, lowered, positions):
    """Removes the delegate outputs at `positions` (descending) from its call and its program."""
    delegate_program = lowered.original_module
    output_node = delegate_program.graph.output_node()
    values = list(output_node.args[0])
    specs = delegate_program.graph_signature.output_specs
    results = list(call.meta["val"])
    for position in positions:
        del values[position], specs[position], results[position]
        # Setting a user's args re-registers it among call.users: iterate over a copy.
        for user in list(call.users):
            if user.args[1] > position:
                user.args = (call, user.args[1] - 1)
    output_node.args = (tuple(values),)
    # Every output of a delegate's program is a user output: its call signature lists them all.
    delegate_program.module_call_graph[0].signature.out_spec = pytree.tree_structure(tuple(range(len(values))))
    call.meta["val"] = tuple(results)
    delegate_program.graph.eliminate_dead_code()
    delegate_program.graph_module.recompile()


def _refuse_other_readers_of_positions(graph, marked, owners, method):
    """The runtime's positions and slots reach only the delegates that own the caches: any other
    reader (a rotary embedding or a mask outside them, another backend) would see the caller's."""
    runtime = marked[0].meta[RUNTIME_KV].runtime_kv
    filled = {runtime.positions: "positions"}
    filled.update({node.meta[RUNTIME_KV].layer.slots: "slots" for node in marked if node.meta[RUNTIME_KV].layer.slots})
    placeholders = {node.name: node for node in graph.find_nodes(op="placeholder")}
    for name, what in filled.items():
        readers = [user for user in placeholders[name].users if user not in owners]
        if readers:
            raise RuntimeKVError(
                f"method '{method}': the {what} input '{name}' is read outside the zerokv delegate that owns the "
                f"runtime KV caches (by {', '.join(reader.name for reader in readers)}); the runtime fills it with "
                "the step's positions for that delegate only, so everything that reads it must be in that delegate")


def _bind_inside(delegate_program, positions):
    """Makes the delegate's user inputs at `positions` buffers of its own program (zeros at their
    example shapes): ExecuTorch runs that program for shape propagation with the arguments the
    delegate now takes. The processed blob, not this program, is what runs; nothing here is saved."""
    signature = delegate_program.graph_signature
    user_specs = [spec for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
    owned = [user_specs[position] for position in positions]
    placeholders = {node.name: node for node in delegate_program.graph.find_nodes(op="placeholder")}
    # Lifted inputs are matched to placeholders by position: the new buffers go, in their specs'
    # order, before the first user input that stays one (none: they already are in that order).
    kept = [placeholders[spec.arg.name] for spec in user_specs if spec not in owned]
    for spec in owned:
        node = placeholders[spec.arg.name]
        value = node.meta["val"]
        shape = [int(extent.node.hint) if isinstance(extent, torch.SymInt) else int(extent) for extent in value.shape]
        spec.kind = InputKind.BUFFER
        spec.target = f"_zerokv_runtime_kv_{spec.arg.name}"
        spec.persistent = True
        delegate_program.state_dict[spec.target] = torch.zeros(shape, dtype=value.dtype)
        if kept:
            kept[0].prepend(node)
    signature.input_specs[:] = [s for s in signature.input_specs if s.kind != InputKind.USER_INPUT] + [
        s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    names = {spec.arg.name for spec in owned}
    call = delegate_program.module_call_graph[0].signature
    call.inputs[:] = [arg for arg in call.inputs if getattr(arg, "name", None) not in names]
    call.in_spec = pytree.tree_structure((tuple(range(len(user_specs) - len(owned))), {}))
    delegate_program.graph_module.recompile()


def manifest_layers(placeholders, bindings, delegate: str):
    """The blob's KV manifest for a delegate's marked inputs (binding names as the engine calls them)."""
    by_name = {binding.name: binding for binding in bindings}
    layers = {}
    for node in placeholders:
        marked = node.meta.get(RUNTIME_KV)
        if marked is not None:
            layers.setdefault(marked.storage_key, {})[marked.role] = (node.name, marked)
    manifest = []
    for storage_key, roles in layers.items():
        if set(roles) != {"k", "v"}:
            raise RuntimeKVError(f"{delegate}: layer {storage_key} has only its {sorted(roles)} cache in this delegate")
        (k_name, marked), (v_name, _) = roles["k"], roles["v"]
        k_binding = by_name[k_name]
        layer = marked.layer
        heads, head_dim = k_binding.shape[1].max, k_binding.shape[3].max
        if layer.max_capacity > k_binding.shape[POSITIONS_DIM].max:
            raise RuntimeKVError(
                f"{delegate}: cache '{k_name}' was exported for at most {k_binding.shape[POSITIONS_DIM].max} "
                f"positions, but max_capacity is {layer.max_capacity}")
        window = layer.window if layer.policy == "ring" else 0
        initial = layer.window if layer.policy == "ring" else layer.initial_capacity
        if initial < k_binding.shape[POSITIONS_DIM].min:
            raise RuntimeKVError(
                f"{delegate}: cache '{k_name}' was exported for at least {k_binding.shape[POSITIONS_DIM].min} "
                f"positions, but its initial capacity is {initial}")
        manifest.append(blob.KVLayer(
            k_binding=k_name,
            v_binding=v_name,
            storage_key=storage_key,
            dtype=k_binding.dtype,
            heads=heads,
            head_dim=head_dim,
            policy=blob.KVPolicy.RING if layer.policy == "ring" else blob.KVPolicy.FLAT,
            window=window,
            initial_capacity=initial,
            max_capacity=layer.max_capacity,
            slots_binding=layer.slots,
        ))
    return manifest


def step_width_source(marked_placeholders, argument_inputs, delegate: str) -> str:
    """The blob's "input_index:dim", the index counted over the delegate's argument inputs."""
    if not marked_placeholders:
        return ""
    input_name, dim = marked_placeholders[0].meta[RUNTIME_KV].runtime_kv.step_width
    if input_name not in argument_inputs:
        raise RuntimeKVError(
            f"{delegate}: the step width input '{input_name}' is not an input of the delegate that owns the caches")
    return f"{argument_inputs.index(input_name)}:{dim}"


def positions_binding(marked_placeholders, argument_inputs, delegate: str) -> str:
    """The blob's positions_binding: the delegate's input the runtime fills with the step's positions."""
    if not marked_placeholders:
        return ""
    runtime_kv = marked_placeholders[0].meta[RUNTIME_KV].runtime_kv
    names = [runtime_kv.positions, *(node.meta[RUNTIME_KV].layer.slots for node in marked_placeholders)]
    for name in filter(None, names):
        if name not in argument_inputs:
            raise RuntimeKVError(f"{delegate}: the input '{name}' the runtime fills with positions is not an input "
                                 "of the delegate that owns the caches")
    return runtime_kv.positions
