"""Reads and writes zerokv delegate blobs, enforcing every rule of the format.

The byte layout comes from the generated `format_generated` module (tools/blob_schema); this module
adds the rules that tie fields together. cc/blob/blob.cc enforces the same rules with the same error
codes: the cross-language fixtures in tests/blob check that both refuse each bad blob alike.
"""

import dataclasses
import re

from zerokv.blob.format_generated import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    PAYLOAD_ALIGNMENT,
    AliasKind,
    BlobFormatError,
    Direction,
    DType,
    ErrorCode,
    Header,
    KVPolicy,
    Metadata,
    decode_metadata,
    encode_metadata,
    read_header,
    write_header,
)

_STEP_WIDTH_SOURCE = re.compile(r"(0|[1-9][0-9]{0,8}):(0|[1-9][0-9]{0,8})")


@dataclasses.dataclass
class Blob:
    """A parsed or to-be-written delegate blob."""

    engine_kind: object  # EngineKind
    device_id: int
    aliased_outputs_elided: bool
    metadata: Metadata
    payload: bytes  # the engine code; empty when metadata.engine_key names the engine's named data
    # The version the blob was written in (parse), or is to be written in (serialize).
    format_version: int = FORMAT_VERSION


@dataclasses.dataclass(frozen=True)
class DelegateSignature:
    """Which bindings are delegate arguments, in argument order (indices into metadata.bindings).

    Inputs come first, then outputs. Runtime-owned KV inputs are never arguments (the runtime binds
    its own storage), nor are outputs aliased to them; the other aliased outputs are arguments
    unless the blob records them as elided.
    """

    inputs: tuple
    outputs: tuple

    @property
    def arity(self):
        return len(self.inputs) + len(self.outputs)


def _fail(code, field, detail):
    raise BlobFormatError(code, field, detail)


def delegate_signature(metadata, aliased_outputs_elided):
    runtime_owned = {name for layer in metadata.kv_layers for name in (layer.k_binding, layer.v_binding)}
    aliased = {alias.output: alias.input for alias in metadata.aliased_io}
    inputs, outputs = [], []
    for index, binding in enumerate(metadata.bindings):
        if binding.direction == Direction.INPUT:
            if binding.name not in runtime_owned:
                inputs.append(index)
        elif binding.name not in aliased:
            outputs.append(index)
        elif aliased[binding.name] not in runtime_owned and not aliased_outputs_elided:
            outputs.append(index)
    return DelegateSignature(tuple(inputs), tuple(outputs))


def _validate_header(header, blob_length):
    if header.header_size != HEADER_SIZE:
        _fail(ErrorCode.BAD_HEADER, "header.header_size", f"{header.header_size}, expected {HEADER_SIZE}")
    if header.reserved != 0:
        _fail(ErrorCode.BAD_HEADER, "header.reserved", f"{header.reserved}, must be 0")
    if header.device_id < 0:
        _fail(ErrorCode.BAD_HEADER, "header.device_id", f"{header.device_id} is negative")
    if header.blob_size != blob_length:
        _fail(ErrorCode.BAD_HEADER, "header.blob_size", f"says {header.blob_size} bytes, the blob holds {blob_length}")
    sections = [
        ("metadata", header.metadata_offset, header.metadata_size),
        ("payload", header.payload_offset, header.payload_size),
    ]
    for name, offset, size in sections:
        if offset > blob_length or size > blob_length - offset:
            _fail(ErrorCode.OUT_OF_RANGE, f"header.{name}_offset",
                  f"[{offset}, {offset} + {size}) lies outside the {blob_length}-byte blob")
    for name, offset, size in sections:
        if offset < HEADER_SIZE and size > 0:
            _fail(ErrorCode.OVERLAP, f"header.{name}_offset", f"{offset} overlaps the {HEADER_SIZE}-byte header")
    (_, m_offset, m_size), (_, p_offset, p_size) = sections
    if m_offset < p_offset + p_size and p_offset < m_offset + m_size:
        _fail(ErrorCode.OVERLAP, "header.payload_offset",
              f"payload [{p_offset}, {p_offset + p_size}) overlaps metadata [{m_offset}, {m_offset + m_size})")
    if p_offset % PAYLOAD_ALIGNMENT:
        _fail(ErrorCode.MISALIGNED_PAYLOAD, "header.payload_offset",
              f"{p_offset} is not a multiple of {PAYLOAD_ALIGNMENT}")


def _validate_named_data(metadata, payload_size):
    """The engine is the payload or a named data entry, never both; constants are placeable."""
    if payload_size == 0 and not metadata.engine_key:
        _fail(ErrorCode.OUT_OF_RANGE, "header.payload_size",
              "the engine payload is empty and metadata.engine_key names no named data entry")
    if payload_size and metadata.engine_key:
        _fail(ErrorCode.BAD_NAMED_DATA, "metadata.engine_key",
              f"'{metadata.engine_key}', but the engine is also the {payload_size}-byte payload")
    names = set()
    for i, constant in enumerate(metadata.constants):
        field = f"metadata.constants[{i}]"
        if constant.name in names:
            _fail(ErrorCode.BAD_NAMED_DATA, f"{field}.name", f"'{constant.name}' is already a constant")
        names.add(constant.name)
        if len(constant.strides) != len(constant.sizes):
            _fail(ErrorCode.BAD_NAMED_DATA, f"{field}.strides",
                  f"{len(constant.strides)} strides for the {len(constant.sizes)} sizes of '{constant.name}'")
        for role in ("sizes", "strides"):
            for d, extent in enumerate(getattr(constant, role)):
                if extent < 0:
                    _fail(ErrorCode.BAD_NAMED_DATA, f"{field}.{role}[{d}]", f"{extent} is negative in '{constant.name}'")
        if constant.storage_offset < 0:
            _fail(ErrorCode.BAD_NAMED_DATA, f"{field}.storage_offset",
                  f"{constant.storage_offset} is negative in '{constant.name}'")


def _validate_metadata(metadata, aliased_outputs_elided, format_version):
    bindings = {}
    for i, binding in enumerate(metadata.bindings):
        field = f"metadata.bindings[{i}]"
        for d, dim in enumerate(binding.shape):
            if dim.min < 0 or (dim.max != -1 and dim.max < dim.min) or dim.max < -1:
                _fail(ErrorCode.BAD_SHAPE, f"{field}.shape[{d}]", f"bounds [{dim.min}, {dim.max}] of '{binding.name}'")
        if binding.name in bindings:
            _fail(ErrorCode.DUPLICATE_BINDING, f"{field}.name", f"'{binding.name}' is already a binding")
        bindings[binding.name] = binding

    aliased_outputs, aliased_inputs = set(), set()
    for i, alias in enumerate(metadata.aliased_io):
        field = f"metadata.aliased_io[{i}]"
        output, input_ = bindings.get(alias.output), bindings.get(alias.input)
        if output is None or output.direction != Direction.OUTPUT:
            _fail(ErrorCode.UNKNOWN_ALIAS_BINDING, f"{field}.output", f"'{alias.output}' is not an output binding")
        if input_ is None or input_.direction != Direction.INPUT:
            _fail(ErrorCode.UNKNOWN_ALIAS_BINDING, f"{field}.input", f"'{alias.input}' is not an input binding")
        if alias.output in aliased_outputs:
            _fail(ErrorCode.DUPLICATE_ALIAS, f"{field}.output", f"'{alias.output}' is already aliased")
        if alias.input in aliased_inputs:
            _fail(ErrorCode.DUPLICATE_ALIAS, f"{field}.input", f"'{alias.input}' is already the target of an alias")
        aliased_outputs.add(alias.output)
        aliased_inputs.add(alias.input)
        if (output.dtype, output.device, output.shape) != (input_.dtype, input_.device, input_.shape):
            _fail(ErrorCode.ALIAS_MISMATCH, field,
                  f"'{alias.output}' and '{alias.input}' differ in dtype, device or shape")
    if aliased_outputs_elided and not metadata.aliased_io:
        _fail(ErrorCode.ELISION_WITHOUT_ALIASES, "header.aliased_outputs_elided", "set, but aliased_io is empty")

    runtime_owned, storage_keys = set(), set()
    for i, layer in enumerate(metadata.kv_layers):
        field = f"metadata.kv_layers[{i}]"
        if layer.storage_key in storage_keys:
            _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.storage_key", f"'{layer.storage_key}' names another layer too")
        storage_keys.add(layer.storage_key)
        for role in ("k_binding", "v_binding"):
            name = getattr(layer, role)
            binding = bindings.get(name)
            if binding is None or binding.direction != Direction.INPUT:
                _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.{role}", f"'{name}' is not an input binding")
            if name in runtime_owned:
                _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.{role}", f"'{name}' is already a runtime-owned cache")
            runtime_owned.add(name)
            if binding.dtype != layer.dtype:
                _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.dtype",
                      f"{layer.dtype.name}, but binding '{name}' is {binding.dtype.name}")
            dims = binding.shape
            if len(dims) != 4 or (dims[1].min, dims[1].max) != (layer.heads, layer.heads) or (
                    dims[3].min, dims[3].max) != (layer.head_dim, layer.head_dim):
                _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.{role}",
                      f"'{name}' is not [batch, {layer.heads} heads, positions, {layer.head_dim}]")
        if layer.heads == 0 or layer.head_dim == 0:
            _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.heads", "heads and head_dim must be positive")
        if layer.policy == KVPolicy.RING and layer.window == 0:
            _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.window", "a ring cache needs a window")
        if layer.policy == KVPolicy.FLAT and layer.window != 0:
            _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.window", f"{layer.window} on a flat cache")
        if not 0 < layer.initial_capacity <= layer.max_capacity:
            _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.initial_capacity",
                  f"needs 0 < initial_capacity ({layer.initial_capacity}) <= max_capacity ({layer.max_capacity})")
        if layer.policy == KVPolicy.RING and layer.window > layer.max_capacity:
            _fail(ErrorCode.BAD_KV_MANIFEST, f"{field}.window",
                  f"window {layer.window} exceeds max_capacity {layer.max_capacity}")

    for i, alias in enumerate(metadata.aliased_io):
        if alias.input in runtime_owned and alias.kind != AliasKind.KV_CACHE_UPDATE:
            _fail(ErrorCode.BAD_KV_MANIFEST, f"metadata.aliased_io[{i}].kind",
                  f"'{alias.input}' is runtime-owned, so its alias must be kv_cache_update")

    _validate_runtime_indices(metadata, bindings, runtime_owned, format_version)
    source = metadata.step_width_source
    if not metadata.kv_layers:
        if source:
            _fail(ErrorCode.BAD_STEP_WIDTH_SOURCE, "metadata.step_width_source", f"'{source}' without a KV manifest")
        return
    match = _STEP_WIDTH_SOURCE.fullmatch(source)
    if not match:
        _fail(ErrorCode.BAD_STEP_WIDTH_SOURCE, "metadata.step_width_source", f"'{source}' is not 'input_index:dim'")
    signature = delegate_signature(metadata, aliased_outputs_elided)
    input_index, dim = int(match.group(1)), int(match.group(2))
    if input_index >= len(signature.inputs):
        _fail(ErrorCode.BAD_STEP_WIDTH_SOURCE, "metadata.step_width_source",
              f"input {input_index}, but the delegate takes {len(signature.inputs)} inputs")
    binding = metadata.bindings[signature.inputs[input_index]]
    if dim >= len(binding.shape):
        _fail(ErrorCode.BAD_STEP_WIDTH_SOURCE, "metadata.step_width_source",
              f"dim {dim} of '{binding.name}', which has rank {len(binding.shape)}")


def _validate_runtime_indices(metadata, bindings, runtime_owned, format_version):
    """positions_binding and the ring layers' slots_binding: integer argument inputs the runtime fills
    (from format version 2; a version 1 model reads the positions its caller gives)."""
    def check(name, field):
        binding = bindings.get(name)
        if binding is None or binding.direction != Direction.INPUT or name in runtime_owned:
            _fail(ErrorCode.BAD_POSITIONS_BINDING, field, f"'{name}' is not a delegate argument input")
        if binding.dtype not in (DType.INT32, DType.INT64):
            _fail(ErrorCode.BAD_POSITIONS_BINDING, field, f"'{name}' is {binding.dtype.name}, not INT32 or INT64")

    positions = metadata.positions_binding
    if not metadata.kv_layers:
        if positions:
            _fail(ErrorCode.BAD_POSITIONS_BINDING, "metadata.positions_binding", f"'{positions}' without a KV manifest")
        return
    if format_version < 2:
        return
    if not positions:
        _fail(ErrorCode.BAD_POSITIONS_BINDING, "metadata.positions_binding",
              "empty, but the runtime supplies the positions of every step over runtime-owned caches")
    check(positions, "metadata.positions_binding")
    windows = {}
    for i, layer in enumerate(metadata.kv_layers):
        field = f"metadata.kv_layers[{i}].slots_binding"
        slots = layer.slots_binding
        if layer.policy == KVPolicy.FLAT:
            if slots:
                _fail(ErrorCode.BAD_POSITIONS_BINDING, field, f"'{slots}' on a flat cache")
            continue
        if not slots:
            _fail(ErrorCode.BAD_POSITIONS_BINDING, field, "empty, but the runtime supplies a ring cache's write slots")
        if slots == positions:
            _fail(ErrorCode.BAD_POSITIONS_BINDING, field, f"'{slots}' is positions_binding too")
        check(slots, field)
        if windows.setdefault(slots, layer.window) != layer.window:
            _fail(ErrorCode.BAD_POSITIONS_BINDING, field,
                  f"'{slots}' serves ring caches of windows {windows[slots]} and {layer.window}")


def _header_for(blob, metadata_size):
    metadata_offset = HEADER_SIZE
    payload_offset = -(-(metadata_offset + metadata_size) // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT
    return Header(
        magic=MAGIC,
        format_version=blob.format_version,
        header_size=HEADER_SIZE,
        engine_kind=blob.engine_kind,
        aliased_outputs_elided=blob.aliased_outputs_elided,
        reserved=0,
        device_id=blob.device_id,
        blob_size=payload_offset + len(blob.payload),
        metadata_offset=metadata_offset,
        metadata_size=metadata_size,
        payload_offset=payload_offset,
        payload_size=len(blob.payload),
    )


def serialize(blob):
    """The bytes of `blob` in blob.format_version; BlobFormatError if it breaks a rule or that
    version cannot hold it (nothing invalid is ever written)."""
    metadata = encode_metadata(blob.metadata, blob.format_version)
    header = _header_for(blob, len(metadata))
    _validate_header(header, header.blob_size)
    _validate_named_data(blob.metadata, header.payload_size)
    _validate_metadata(blob.metadata, blob.aliased_outputs_elided, blob.format_version)
    padding = b"\0" * (header.payload_offset - HEADER_SIZE - len(metadata))
    return write_header(header) + metadata + padding + bytes(blob.payload)


def parse(data):
    """The Blob in `data`, or BlobFormatError naming the rule and the field at fault."""
    data = bytes(data)
    header = read_header(data)
    _validate_header(header, len(data))
    metadata = decode_metadata(data[header.metadata_offset:header.metadata_offset + header.metadata_size],
                               header.format_version)
    _validate_named_data(metadata, header.payload_size)
    _validate_metadata(metadata, header.aliased_outputs_elided, header.format_version)
    return Blob(
        engine_kind=header.engine_kind,
        device_id=header.device_id,
        aliased_outputs_elided=header.aliased_outputs_elided,
        metadata=metadata,
        payload=data[header.payload_offset:header.payload_offset + header.payload_size],
        format_version=header.format_version,
    )
