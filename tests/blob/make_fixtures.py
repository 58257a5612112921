"""Writes the blob fixtures shared by the Python and C++ tests and the fuzzer's seed corpus.

    make_fixtures.py OUT_DIR [FROZEN_DIR/FILE ...]
writes OUT_DIR/<case>.blob for every case and OUT_DIR/MANIFEST, one line per case:
"<case> OK" for a valid blob (which writes back to the same bytes), "<case> OK=<other>" for one that
parses to what case <other> parses to (fields it does not know skipped), "<case> <ERROR_CODE>" for
one both parsers must refuse with that code.

The FROZEN files are the fixtures an older format version's codec wrote (tests/blob/v<N>/: its
blobs and their MANIFEST), copied as "v<N>_<case>": they are never regenerated, so that every
version stays readable.

Each bad case breaks exactly one rule of the format, starting from a valid blob, so that a parser
that checks rules in another order still reports the same code.
"""

import collections
import copy
import dataclasses
import os
import struct
import sys

from zerokv.blob import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    AliasedIO,
    AliasKind,
    Blob,
    Constant,
    Device,
    Dim,
    Direction,
    DType,
    EngineKind,
    IOBinding,
    KVLayer,
    KVPolicy,
    Metadata,
    serialize,
)
from zerokv.blob.format_generated import Header, encode_metadata, read_header, write_header

PAYLOAD = bytes(range(256)) * 3


def _cache(name, direction, positions=64):
    return IOBinding(name, DType.FLOAT32, direction, Device.CUDA, [Dim(1, 1), Dim(2, 2), Dim(positions, positions), Dim(16, 16)])


def caller_kv_blob():
    """AOTI engine writing caller-owned caches in place, aliased outputs elided."""
    return Blob(
        engine_kind=EngineKind.AOTI,
        device_id=0,
        aliased_outputs_elided=True,
        metadata=Metadata(
            bindings=[
                IOBinding("tokens", DType.INT64, Direction.INPUT, Device.CUDA, [Dim(1, 1), Dim(1, 64)]),
                _cache("k_cache", Direction.INPUT),
                _cache("v_cache", Direction.INPUT),
                IOBinding("logits", DType.FLOAT32, Direction.OUTPUT, Device.CUDA, [Dim(1, 1), Dim(1, 64), Dim(32, 32)]),
                _cache("k_cache_out", Direction.OUTPUT),
                _cache("v_cache_out", Direction.OUTPUT),
            ],
            aliased_io=[
                AliasedIO("k_cache_out", "k_cache", AliasKind.KV_CACHE_UPDATE),
                AliasedIO("v_cache_out", "v_cache", AliasKind.KV_CACHE_UPDATE),
            ],
            kv_layers=[],
            step_width_source="",
            positions_binding="",
        ),
        payload=PAYLOAD,
    )


def runtime_kv_blob():
    """TensorRT engine over runtime-owned caches: one flat layer and one ring layer."""
    blob = caller_kv_blob()
    blob.engine_kind = EngineKind.TENSORRT
    blob.device_id = 1
    blob.aliased_outputs_elided = False
    blob.metadata.bindings += [
        _cache("k_ring", Direction.INPUT, 16),
        _cache("v_ring", Direction.INPUT, 16),
        IOBinding("positions", DType.INT64, Direction.INPUT, Device.CUDA, [Dim(1, 64)]),
        IOBinding("ring_slots", DType.INT32, Direction.INPUT, Device.CUDA, [Dim(1, 64)]),
    ]
    blob.metadata.kv_layers = [
        KVLayer("k_cache", "v_cache", "layers.0", DType.FLOAT32, 2, 16, KVPolicy.FLAT, 0, 8, 64, ""),
        KVLayer("k_ring", "v_ring", "layers.1", DType.FLOAT32, 2, 16, KVPolicy.RING, 16, 16, 16, "ring_slots"),
    ]
    blob.metadata.step_width_source = "0:1"
    blob.metadata.positions_binding = "positions"
    return blob


def growable_runtime_kv_blob():
    """runtime_kv_blob with the flat layer's positions dim dynamic, admitting every capacity the
    runtime may grow the cache to: the blob a runtime creates a delegate for."""
    blob = runtime_kv_blob()
    for i, binding in enumerate(blob.metadata.bindings):
        if binding.name in ("k_cache", "v_cache", "k_cache_out", "v_cache_out"):
            shape = list(binding.shape)
            shape[2] = Dim(1, 64)
            blob.metadata.bindings[i] = dataclasses.replace(binding, shape=shape)
    return blob


def named_data_blob():
    """Engine code with its weights in named data, and a TensorRT plan that is all named data."""
    blob = caller_kv_blob()
    blob.metadata.constants = [
        Constant("embed.weight", "zerokv/embed", DType.FLOAT32, [64, 32], [32, 1], 0),
        # A view: the transposed second half of a storage.
        Constant("head.weight", "zerokv/head", DType.BFLOAT16, [16, 8], [1, 16], 128),
        Constant("scale", "zerokv/scale", DType.FLOAT32, [], [], 0),
    ]
    return blob


def plan_in_named_data_blob():
    blob = caller_kv_blob()
    blob.engine_kind = EngineKind.TENSORRT
    blob.metadata.engine_key = "zerokv/plan"
    blob.payload = b""
    return blob


def minimal_blob():
    blob = caller_kv_blob()
    blob.aliased_outputs_elided = False
    blob.metadata.bindings = blob.metadata.bindings[:1] + blob.metadata.bindings[3:4]
    blob.metadata.aliased_io = []
    return blob


def raw(blob, metadata=None, **header_fields):
    """The bytes of `blob` with the rules bypassed: `metadata` replaces the encoded metadata and
    `header_fields` override header fields after the layout is computed."""
    encoded = encode_metadata(blob.metadata, blob.format_version) if metadata is None else metadata
    payload_offset = -(-(HEADER_SIZE + len(encoded)) // 64) * 64
    header = Header(
        magic=MAGIC,
        format_version=blob.format_version,
        header_size=HEADER_SIZE,
        reserved=0,
        engine_kind=blob.engine_kind,
        device_id=blob.device_id,
        aliased_outputs_elided=blob.aliased_outputs_elided,
        blob_size=payload_offset + len(blob.payload),
        metadata_offset=HEADER_SIZE,
        metadata_size=len(encoded),
        payload_offset=payload_offset,
        payload_size=len(blob.payload),
    )
    header = dataclasses.replace(header, **header_fields)
    body = encoded + b"\0" * (payload_offset - HEADER_SIZE - len(encoded)) + blob.payload
    return write_header(header) + body


def edited(make, edit):
    blob = make()
    edit(blob)
    return raw(blob)


def patch(data, offset, new_bytes):
    return data[:offset] + new_bytes + data[offset + len(new_bytes):]


def grown(encoded, struct_offsets, extra):
    """`encoded` with `extra` bytes appended to the struct at struct_offsets[-1], nested in the
    structs at the offsets before it (each a u32 size, then its bytes): a field a later writer added."""
    innermost = struct_offsets[-1]
    (size,) = struct.unpack_from("<I", encoded, innermost)
    end = innermost + 4 + size
    data = bytearray(encoded[:end] + extra + encoded[end:])
    for offset in struct_offsets:
        struct.pack_into("<I", data, offset, struct.unpack_from("<I", data, offset)[0] + len(extra))
    return bytes(data)


def cases():
    good = serialize(caller_kv_blob())
    # metadata.size, metadata.bindings.count, bindings[0].size, then bindings[0].name.length
    name_length_at = HEADER_SIZE + 12
    yield "valid_caller_kv", "OK", good
    yield "valid_runtime_kv", "OK", serialize(runtime_kv_blob())
    yield "valid_growable_runtime_kv", "OK", serialize(growable_runtime_kv_blob())
    yield "valid_minimal", "OK", serialize(minimal_blob())
    yield "valid_constants", "OK", serialize(named_data_blob())
    yield "valid_plan_in_named_data", "OK", serialize(plan_in_named_data_blob())

    meta = encode_metadata(caller_kv_blob().metadata)
    binding_at = 8  # metadata.size, metadata.bindings.count, then bindings[0]
    # Fields a later writer added (schema.added) are skipped: at the end of the metadata, and at the
    # end of bindings[0].
    yield "later_metadata_field", "OK=valid_caller_kv", raw(caller_kv_blob(), metadata=grown(meta, [0], b"\x05later"))
    yield "later_binding_field", "OK=valid_caller_kv", raw(
        caller_kv_blob(), metadata=grown(meta, [0, binding_at], b"\x01\x02"))

    yield "bad_magic", "BAD_MAGIC", b"ZKVX" + good[4:]
    yield "newer_version", "UNSUPPORTED_VERSION", raw(caller_kv_blob(), format_version=FORMAT_VERSION + 1)
    yield "version_zero", "UNSUPPORTED_VERSION", raw(caller_kv_blob(), format_version=0)
    yield "truncated_header", "TRUNCATED_HEADER", good[:HEADER_SIZE - 1]
    yield "bad_header_size", "BAD_HEADER", raw(caller_kv_blob(), header_size=48)
    yield "reserved_nonzero", "BAD_HEADER", raw(caller_kv_blob(), reserved=1)
    yield "blob_size_mismatch", "BAD_HEADER", good + b"\0" * 64
    yield "truncated_payload", "BAD_HEADER", good[:-1]
    yield "bad_engine_kind", "BAD_ENUM", patch(good, 8, b"\x07")
    yield "bad_elided_bool", "BAD_ENUM", patch(good, 9, b"\x02")
    yield "metadata_out_of_range", "OUT_OF_RANGE", raw(caller_kv_blob(), metadata_size=len(good))
    yield "payload_out_of_range", "OUT_OF_RANGE", raw(caller_kv_blob(), payload_size=len(good))
    yield "payload_offset_overflow", "OUT_OF_RANGE", raw(caller_kv_blob(), payload_offset=2**64 - 64)
    yield "empty_payload", "OUT_OF_RANGE", raw(caller_kv_blob(), payload_size=0)
    yield "metadata_overlaps_header", "OVERLAP", raw(caller_kv_blob(), metadata_offset=8)
    yield "payload_overlaps_metadata", "OVERLAP", raw(caller_kv_blob(), payload_offset=64, payload_size=len(PAYLOAD))
    yield "misaligned_payload", "MISALIGNED_PAYLOAD", raw(
        caller_kv_blob(), payload_offset=read_header(good).payload_offset + 8, payload_size=len(PAYLOAD) - 8)
    yield "truncated_metadata", "TRUNCATED", raw(caller_kv_blob(), metadata=meta[:-3])
    yield "struct_past_end", "TRUNCATED", raw(
        caller_kv_blob(), metadata=patch(meta, binding_at, struct.pack("<I", len(meta))))
    yield "string_past_end", "TRUNCATED", raw(
        caller_kv_blob(), metadata=patch(meta, name_length_at - HEADER_SIZE, struct.pack("<I", 10**6)))
    yield "count_overflow", "COUNT_OVERFLOW", raw(caller_kv_blob(), metadata=patch(meta, 4, struct.pack("<I", 2**32 - 1)))
    yield "trailing_bytes", "TRAILING_BYTES", raw(caller_kv_blob(), metadata=meta + b"\0")
    assert good[name_length_at:name_length_at + 4] == struct.pack("<I", len("tokens"))
    assert good[HEADER_SIZE + 4:HEADER_SIZE + 8] == struct.pack("<I", len(caller_kv_blob().metadata.bindings))

    def binding(i, **fields):
        def edit(blob):
            blob.metadata.bindings[i] = dataclasses.replace(blob.metadata.bindings[i], **fields)
        return edit

    def metadata(**fields):
        def edit(blob):
            blob.metadata = dataclasses.replace(blob.metadata, **fields)
        return edit

    def kv_layer(i, **fields):
        def edit(blob):
            blob.metadata.kv_layers[i] = dataclasses.replace(blob.metadata.kv_layers[i], **fields)
        return edit

    yield "bad_dtype_enum", "BAD_ENUM", patch(good, name_length_at + 4 + len("tokens"), b"\x00")
    yield "empty_name", "BAD_STRING", edited(caller_kv_blob, binding(0, name=""))
    yield "nul_in_name", "BAD_STRING", edited(caller_kv_blob, binding(0, name="tok\0ens"))
    yield "non_utf8_name", "BAD_STRING", patch(good, name_length_at + 4, b"\xff")
    yield "negative_dim", "BAD_SHAPE", edited(caller_kv_blob, binding(0, shape=[Dim(-1, 1)]))
    yield "dim_min_above_max", "BAD_SHAPE", edited(caller_kv_blob, binding(0, shape=[Dim(4, 2)]))
    yield "duplicate_binding", "DUPLICATE_BINDING", edited(caller_kv_blob, binding(3, name="tokens"))
    yield "duplicate_alias_output", "DUPLICATE_ALIAS", edited(caller_kv_blob, lambda b: b.metadata.aliased_io.append(
        AliasedIO("k_cache_out", "v_cache", AliasKind.KV_CACHE_UPDATE)))
    yield "repeated_alias_entry", "DUPLICATE_ALIAS", edited(caller_kv_blob, lambda b: b.metadata.aliased_io.append(
        copy.copy(b.metadata.aliased_io[0])))
    yield "duplicate_alias_input", "DUPLICATE_ALIAS", edited(caller_kv_blob, lambda b: b.metadata.aliased_io.__setitem__(
        1, AliasedIO("v_cache_out", "k_cache", AliasKind.KV_CACHE_UPDATE)))
    yield "alias_unknown_output", "UNKNOWN_ALIAS_BINDING", edited(caller_kv_blob, lambda b: b.metadata.aliased_io.__setitem__(
        0, AliasedIO("nope", "k_cache", AliasKind.KV_CACHE_UPDATE)))
    yield "alias_input_is_output", "UNKNOWN_ALIAS_BINDING", edited(caller_kv_blob, lambda b: b.metadata.aliased_io.__setitem__(
        0, AliasedIO("k_cache_out", "logits", AliasKind.USER)))
    yield "alias_shape_mismatch", "ALIAS_MISMATCH", edited(caller_kv_blob, binding(4, shape=[Dim(1, 1)]))
    yield "elision_without_aliases", "ELISION_WITHOUT_ALIASES", edited(
        minimal_blob, lambda b: setattr(b, "aliased_outputs_elided", True))
    yield "kv_unknown_binding", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(0, k_binding="k_missing"))
    yield "kv_output_binding", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(0, k_binding="logits"))
    yield "kv_dtype_mismatch", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(0, dtype=DType.BFLOAT16))
    yield "kv_heads_mismatch", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(0, heads=4))
    yield "kv_ring_without_window", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(1, window=0))
    yield "kv_capacity_above_max", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(0, initial_capacity=128))
    yield "kv_binding_twice", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(1, k_binding="k_cache"))
    yield "kv_storage_key_twice", "BAD_KV_MANIFEST", edited(runtime_kv_blob, kv_layer(1, storage_key="layers.0"))
    yield "step_width_malformed", "BAD_STEP_WIDTH_SOURCE", edited(runtime_kv_blob, metadata(step_width_source="0-1"))
    yield "step_width_bad_input", "BAD_STEP_WIDTH_SOURCE", edited(runtime_kv_blob, metadata(step_width_source="5:0"))
    yield "step_width_bad_dim", "BAD_STEP_WIDTH_SOURCE", edited(runtime_kv_blob, metadata(step_width_source="0:2"))
    yield "step_width_without_kv", "BAD_STEP_WIDTH_SOURCE", edited(caller_kv_blob, metadata(step_width_source="0:1"))
    positions_at = [b.name for b in runtime_kv_blob().metadata.bindings].index("positions")
    yield "positions_missing", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, metadata(positions_binding=""))
    yield "positions_without_kv", "BAD_POSITIONS_BINDING", edited(caller_kv_blob, metadata(positions_binding="tokens"))
    yield "positions_unknown", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, metadata(positions_binding="nope"))
    yield "positions_runtime_owned", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, metadata(positions_binding="k_ring"))
    yield "positions_output", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, metadata(positions_binding="logits"))
    yield "positions_float", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, binding(positions_at, dtype=DType.FLOAT32))
    yield "slots_on_flat", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, kv_layer(0, slots_binding="ring_slots"))
    yield "ring_without_slots", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, kv_layer(1, slots_binding=""))
    yield "slots_are_positions", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, kv_layer(1, slots_binding="positions"))
    yield "slots_runtime_owned", "BAD_POSITIONS_BINDING", edited(runtime_kv_blob, kv_layer(1, slots_binding="k_cache"))

    def constant(i, **fields):
        def edit(blob):
            blob.metadata.constants[i] = dataclasses.replace(blob.metadata.constants[i], **fields)
        return edit

    yield "engine_in_payload_and_named_data", "BAD_NAMED_DATA", edited(
        plan_in_named_data_blob, lambda b: setattr(b, "payload", PAYLOAD))
    yield "constant_named_twice", "BAD_NAMED_DATA", edited(named_data_blob, constant(1, name="embed.weight"))
    yield "constant_rank_mismatch", "BAD_NAMED_DATA", edited(named_data_blob, constant(0, strides=[32]))
    yield "constant_negative_size", "BAD_NAMED_DATA", edited(named_data_blob, constant(0, sizes=[64, -32]))
    yield "constant_negative_stride", "BAD_NAMED_DATA", edited(named_data_blob, constant(1, strides=[1, -16]))
    yield "constant_negative_offset", "BAD_NAMED_DATA", edited(named_data_blob, constant(1, storage_offset=-1))
    yield "constant_empty_key", "BAD_STRING", edited(named_data_blob, constant(2, key=""))


def frozen_cases(paths):
    """The cases of each older version's frozen fixtures, as (name, expected, bytes)."""
    by_dir = collections.defaultdict(dict)
    for path in paths:
        by_dir[os.path.dirname(path)][os.path.basename(path)] = path
    for directory, files in sorted(by_dir.items()):
        version = os.path.basename(directory)
        with open(files["MANIFEST"]) as manifest:
            for line in manifest:
                if line.strip():
                    name, expected = line.split()
                    with open(files[name + ".blob"], "rb") as f:
                        yield f"{version}_{name}", expected, f.read()


def main():
    out_dir, frozen = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    lines = []
    for name, expected, data in [*cases(), *frozen_cases(frozen)]:
        with open(os.path.join(out_dir, name + ".blob"), "wb") as f:
            f.write(data)
        lines.append(f"{name} {expected}")
    with open(os.path.join(out_dir, "MANIFEST"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
