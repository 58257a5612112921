"""The zerokv delegate blob: what `preprocess` writes and the C++ runtime reads.

    blob.serialize(Blob(...)) -> bytes        blob.parse(bytes) -> Blob
Both raise BlobFormatError(code, field) for anything that breaks a rule of the format.
"""

from zerokv.blob.codec import Blob, DelegateSignature, delegate_signature, parse, serialize
from zerokv.blob.format_generated import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    PAYLOAD_ALIGNMENT,
    AliasedIO,
    AliasKind,
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

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "PAYLOAD_ALIGNMENT",
    "AliasKind",
    "AliasedIO",
    "Blob",
    "BlobFormatError",
    "DType",
    "DelegateSignature",
    "Device",
    "Dim",
    "Direction",
    "EngineKind",
    "ErrorCode",
    "IOBinding",
    "KVLayer",
    "KVPolicy",
    "Metadata",
    "delegate_signature",
    "parse",
    "serialize",
]
