"""The zerokv delegate blob: the one definition of its format.

generate.py turns this module into the Python codec (zerokv.blob) and the C++ header (cc/blob)
that both sides build from. Nothing else may define a field, an enum value or an error code.

Layout, little-endian, every field fixed-width:

    header     HEADER_FIELDS, HEADER_SIZE bytes at offset 0 (the same in every version)
    metadata   the Metadata struct at [metadata_offset, metadata_offset + metadata_size)
    payload    the engine code at [payload_offset, payload_offset + payload_size), payload_offset a
               multiple of PAYLOAD_ALIGNMENT: the AOTInductor package (kernels, no weights since
               version 3). Empty when the engine lives in ExecuTorch's named data (a TensorRT plan,
               metadata.engine_key).

Inside the metadata a string is a u32 byte length then that many UTF-8 bytes (no NUL); a list is a
u32 count then its elements. A struct is a u32 byte size then its fields in order (versions 1 and
2: its fields in order, with no size). Nothing depends on key order.

How the format evolves:

  - A reader reads every version from 1 to FORMAT_VERSION and refuses a newer one
    (UNSUPPORTED_VERSION, naming both versions): MAGIC and format_version open every version.
  - A field that a reader may ignore is added at the end of its struct with added(version,
    default), without a new version: a reader skips the bytes after the fields it knows (an older
    runtime ignores the field), and gives the default to a field that a struct ends before (an
    older blob). Such a field must mean nothing when it holds its default.
  - Anything else (a field a reader must act on, a new meaning for an old field, a removed field, a
    new enum value) bumps FORMAT_VERSION, so that an older runtime refuses the blob by name.
  - Each version's layout is frozen: versions 1 and 2 had fixed-layout structs (no size prefix),
    each with the fields added() up to it; tests/blob keeps fixtures written by each version's codec.

Versions: 1, the first; 2, runtime-supplied positions (positions_binding, slots_binding); 3,
extensible structs, and weights and plans out of the blob (engine_key, constants); 4, the
MEGAKERNEL engine kind.
"""

MAGIC = b"ZKVB"
# The version the codecs write; they read every version from 1 up to it.
FORMAT_VERSION = 4
# The first version whose structs carry their byte size (and so can grow added() fields).
EXTENSIBLE_SINCE = 3
PAYLOAD_ALIGNMENT = 64

# Scalar field types and their widths in bytes.
SCALARS = {"u8": 1, "u16": 2, "u32": 4, "u64": 8, "i32": 4, "i64": 8, "bool": 1}

# Each enum is stored as a u8. Value 0 is never valid, so a zeroed field is always caught.
# A DType is named after its torch (and TensorRT) dtype, FLOAT32 after torch.float32:
# zerokv.blob.torch_dtypes pairs them by that name.
ENUMS = {
    # MEGAKERNEL: a Llama decode step as one persistent CUDA kernel (cc/engines/megakernel), its
    # payload the step's settings and its weights constants.
    "EngineKind": [("TENSORRT", 1), ("AOTI", 2), ("MEGAKERNEL", 3)],
    "DType": [
        ("FLOAT32", 1),
        ("FLOAT16", 2),
        ("BFLOAT16", 3),
        ("INT32", 4),
        ("INT64", 5),
        ("INT8", 6),
        ("UINT8", 7),
        ("BOOL", 8),
    ],
    "Direction": [("INPUT", 1), ("OUTPUT", 2)],
    "Device": [("CPU", 1), ("CUDA", 2)],
    "AliasKind": [("KV_CACHE_UPDATE", 1), ("USER", 2)],
    "KVPolicy": [("FLAT", 1), ("RING", 2)],
}

# Bytes per element of each DType: what a runtime sizes a binding's buffer by.
DTYPE_BYTES = {
    "FLOAT32": 4,
    "FLOAT16": 2,
    "BFLOAT16": 2,
    "INT32": 4,
    "INT64": 8,
    "INT8": 1,
    "UINT8": 1,
    "BOOL": 1,
}

# Every way a blob can be refused. Both codecs report these codes, with a message naming the field.
ERROR_CODES = [
    ("BAD_MAGIC", "the blob does not start with MAGIC"),
    ("UNSUPPORTED_VERSION", "format_version is 0 or newer than FORMAT_VERSION, or a field cannot be written in it"),
    ("TRUNCATED_HEADER", "the blob is shorter than the header"),
    ("BAD_HEADER", "a header field holds an impossible value (header_size, reserved, blob_size)"),
    ("OUT_OF_RANGE", "a section's offset or size lies outside the blob"),
    ("OVERLAP", "two sections overlap"),
    ("MISALIGNED_PAYLOAD", "payload_offset is not a multiple of PAYLOAD_ALIGNMENT"),
    ("TRUNCATED", "a metadata field runs past the end of the metadata"),
    ("COUNT_OVERFLOW", "a list count cannot fit in the bytes that remain"),
    ("TRAILING_BYTES", "bytes remain in the metadata after its last field"),
    ("BAD_ENUM", "an enum field holds a value its enum does not define"),
    ("BAD_STRING", "a string is empty where a name is required, holds NUL or is not UTF-8"),
    ("BAD_SHAPE", "a dimension's bounds are negative or min > max"),
    ("DUPLICATE_BINDING", "two I/O bindings share a name"),
    ("DUPLICATE_ALIAS", "an output is aliased twice"),
    ("UNKNOWN_ALIAS_BINDING", "an alias names a binding that is not there, or of the wrong direction"),
    ("ALIAS_MISMATCH", "an aliased output and its input differ in dtype, device or shape"),
    ("ELISION_WITHOUT_ALIASES", "aliased outputs are marked elided but there are none"),
    ("BAD_KV_MANIFEST", "a KV manifest entry is inconsistent or names no binding"),
    ("BAD_STEP_WIDTH_SOURCE", "step_width_source is not 'input_index:dim' naming an input"),
    ("BAD_POSITIONS_BINDING",
     "positions_binding or a KV layer's slots_binding is missing where required, present where not, or not an "
     "int32/int64 delegate argument input of its own"),
    ("BAD_NAMED_DATA", "the engine is in both the payload and named data, or a constant is inconsistent"),
]


def enum(name):
    return ("enum", name)


def list_of(element):
    return ("list", element)


def added(version, default):
    """Marks a field added in format `version` (see the module docstring): it ends its struct, and a
    reader gives it `default` ("", [], 0 or False) where the blob's version or the struct ends
    before it."""
    return ("added", version, default)


# A name must be non-empty; text may be empty. Neither may hold NUL (C++ consumers stop there).
NAME = ("string", True)
TEXT = ("string", False)

# Fixed header fields in order (name, type); "magic" is MAGIC's 4 bytes.
HEADER_FIELDS = [
    ("magic", "magic"),
    ("format_version", "u16"),
    ("header_size", "u16"),
    ("engine_kind", enum("EngineKind")),
    ("aliased_outputs_elided", "bool"),
    ("reserved", "u16"),
    ("device_id", "i32"),
    ("blob_size", "u64"),
    ("metadata_offset", "u64"),
    ("metadata_size", "u64"),
    ("payload_offset", "u64"),
    ("payload_size", "u64"),
]

# Metadata structs, each defined before its first use. Comments are the fields' contract.
STRUCTS = [
    (
        "Dim",
        [
            # A static extent has min == max; a dynamic one min < max, max == -1 when unbounded.
            ("min", "i64"),
            ("max", "i64"),
        ],
    ),
    (
        "IOBinding",
        [
            ("name", NAME),
            ("dtype", enum("DType")),
            ("direction", enum("Direction")),
            ("device", enum("Device")),
            ("shape", list_of("Dim")),
        ],
    ),
    (
        "AliasedIO",
        [
            # The engine writes `output` through `input`'s memory.
            ("output", NAME),
            ("input", NAME),
            ("kind", enum("AliasKind")),
        ],
    ),
    (
        "KVLayer",
        [
            # A runtime-owned cache: the K and V input bindings the runtime binds to its storage.
            ("k_binding", NAME),
            ("v_binding", NAME),
            # Delegates of one program that name the same key share this layer's storage within a
            # sequence (e.g. the prefill and decode methods); unique per export.
            ("storage_key", NAME),
            ("dtype", enum("DType")),
            ("heads", "u32"),
            ("head_dim", "u32"),
            ("policy", enum("KVPolicy")),
            # Ring caches only: the number of positions kept; 0 for flat caches.
            ("window", "u64"),
            ("initial_capacity", "u64"),
            ("max_capacity", "u64"),
            # Ring caches only: the input binding (a delegate argument, int32 or int64, one element
            # per token of the step) that the runtime fills before each run with the slots the step
            # writes, (position + i) mod window: the modulo is the runtime's, never the model's.
            # Empty for flat caches. Ring layers of one window may share it.
            ("slots_binding", TEXT, added(2, "")),
        ],
    ),
    (
        "Constant",
        [
            # A tensor the engine takes as a constant, by the engine's name for it (AOTInductor: the
            # weight's fully qualified name), read from ExecuTorch's named data entry `key`, which
            # holds the tensor's storage from its first byte. sizes, strides and storage_offset (in
            # elements) place the tensor in that storage.
            ("name", NAME),
            ("key", NAME),
            ("dtype", enum("DType")),
            ("sizes", list_of("i64")),
            ("strides", list_of("i64")),
            ("storage_offset", "i64"),
        ],
    ),
    (
        "Metadata",
        [
            # In the engine's binding order; the delegate's arguments are the inputs in this order,
            # then the outputs in this order minus the aliased ones when aliased_outputs_elided.
            ("bindings", list_of("IOBinding")),
            ("aliased_io", list_of("AliasedIO")),
            ("kv_layers", list_of("KVLayer")),
            # "input_index:dim": the input whose extent along dim is the tokens a step writes; empty
            # when the blob has no runtime-owned caches.
            ("step_width_source", TEXT),
            # The input binding (a delegate argument, int32 or int64) that the runtime fills before
            # each run with the step's positions, [length, length + step) from the committed length,
            # or only the first of them when it holds one element; the caller's tensor supplies the
            # shape, never the values. Required with kv_layers, empty without.
            ("positions_binding", TEXT, added(2, "")),
            # The key of ExecuTorch's named data entry that holds the engine (a TensorRT plan);
            # empty when the engine is the blob's payload.
            ("engine_key", TEXT, added(3, "")),
            # The engine's constants (AOTInductor: its weights), each read from named data at init.
            ("constants", list_of("Constant"), added(3, [])),
        ],
    ),
]
