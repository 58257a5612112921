"""The zerokv delegate blob: what `preprocess` writes and the C++ runtime reads.

    blob.serialize(Blob(...)) -> bytes        blob.parse(bytes) -> Blob
Both raise BlobFormatError(code, field) for anything that breaks a rule of the format. parse reads
every format version up to FORMAT_VERSION (tools/blob_schema/schema.py says how they evolve).
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
    Constant,
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
    "Constant",
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
