import dataclasses

import pytest

from zerokv import blob
from zerokv.blob import (
    AliasedIO,
    AliasKind,
    Blob,
    BlobFormatError,
    Device,
    Dim,
    Direction,
    DType,
    EngineKind,
    ErrorCode,
    IOBinding,
    KVLayer,
    KVPolicy,
    Metadata,
)


def _cache(name, direction):
    return IOBinding(name, DType.BFLOAT16, direction, Device.CUDA, [Dim(1, 1), Dim(4, 4), Dim(128, 128), Dim(8, 8)])


def _blob(**changes):
    value = Blob(
        engine_kind=EngineKind.TENSORRT,
        device_id=3,
        aliased_outputs_elided=True,
        metadata=Metadata(
            bindings=[
                IOBinding("ids", DType.INT32, Direction.INPUT, Device.CUDA, [Dim(1, 1), Dim(1, -1)]),
                _cache("k", Direction.INPUT),
                IOBinding("out", DType.FLOAT16, Direction.OUTPUT, Device.CUDA, [Dim(1, 1)]),
                _cache("k_out", Direction.OUTPUT),
            ],
            aliased_io=[AliasedIO("k_out", "k", AliasKind.KV_CACHE_UPDATE)],
            kv_layers=[],
            step_width_source="",
            positions_binding="",
        ),
        payload=b"\x01" * 1000,
    )
    return dataclasses.replace(value, **changes)


def test_round_trip_keeps_every_field():
    original = _blob()
    data = blob.serialize(original)
    assert data[:4] == blob.MAGIC
    assert blob.parse(data) == original


def test_payload_is_aligned():
    data = blob.serialize(_blob())
    header_payload_offset = int.from_bytes(data[40:48], "little")
    assert header_payload_offset % blob.PAYLOAD_ALIGNMENT == 0
    assert data[header_payload_offset:] == b"\x01" * 1000


def test_unbounded_dynamic_dimension_survives():
    parsed = blob.parse(blob.serialize(_blob()))
    assert parsed.metadata.bindings[0].shape[1] == Dim(1, -1)


def test_serialize_refuses_instead_of_writing_an_invalid_blob():
    bad = _blob()
    bad.metadata.aliased_io.append(AliasedIO("k_out", "k", AliasKind.KV_CACHE_UPDATE))
    with pytest.raises(BlobFormatError) as error:
        blob.serialize(bad)
    assert error.value.code == ErrorCode.DUPLICATE_ALIAS
    assert error.value.field == "metadata.aliased_io[1].output"
    assert "'k_out'" in str(error.value)


def test_serialize_refuses_an_empty_payload():
    with pytest.raises(BlobFormatError) as error:
        blob.serialize(_blob(payload=b""))
    assert error.value.code == ErrorCode.OUT_OF_RANGE


def test_elision_flag_needs_aliases():
    bad = _blob()
    bad.metadata.aliased_io = []
    with pytest.raises(BlobFormatError) as error:
        blob.serialize(bad)
    assert error.value.code == ErrorCode.ELISION_WITHOUT_ALIASES


def test_runtime_owned_alias_must_be_a_kv_update():
    bad = _blob(aliased_outputs_elided=False)
    bad.metadata.aliased_io = [AliasedIO("k_out", "k", AliasKind.USER)]
    bad.metadata.kv_layers = [KVLayer("k", "k", "layers.0.k", DType.BFLOAT16, 4, 8, KVPolicy.FLAT, 0, 16, 128, "")]
    with pytest.raises(BlobFormatError) as error:
        blob.serialize(bad)
    # k named twice in one layer is refused before the alias kind is looked at.
    assert error.value.code == ErrorCode.BAD_KV_MANIFEST
    assert error.value.field == "metadata.kv_layers[0].v_binding"


def test_delegate_signature_follows_the_recorded_elision():
    metadata = _blob().metadata
    assert blob.delegate_signature(metadata, True) == blob.DelegateSignature((0, 1), (2,))
    assert blob.delegate_signature(metadata, False) == blob.DelegateSignature((0, 1), (2, 3))
    assert blob.delegate_signature(metadata, False).arity == 4


def test_every_truncation_is_refused():
    data = blob.serialize(_blob())
    for size in range(len(data)):
        with pytest.raises(BlobFormatError):
            blob.parse(data[:size])


def test_constants_and_engine_key_round_trip():
    original = _blob(payload=b"")
    original.metadata.engine_key = "zerokv/plan"
    original.metadata.constants = [blob.Constant("w", "zerokv/w", DType.BFLOAT16, [4, 2], [1, 4], 3)]
    assert blob.parse(blob.serialize(original)) == original


def test_an_older_version_is_written_only_without_the_fields_it_lacks():
    old = _blob(format_version=1)
    assert blob.parse(blob.serialize(old)) == old
    old.metadata.constants = [blob.Constant("w", "zerokv/w", DType.FLOAT32, [2], [1], 0)]
    with pytest.raises(BlobFormatError) as error:
        blob.serialize(old)
    assert error.value.code == ErrorCode.UNSUPPORTED_VERSION
    assert error.value.field == "metadata.constants"
    assert "format version 1 has no such field" in str(error.value)
