"""The compile specs a zerokv delegate carries (keys; values are UTF-8 bytes)."""

from zerokv.errors import ZeroKVError

# Read by ExecuTorch's PropagateDevicePass: b"cuda:N".
TARGET_DEVICE = "target_device"
# b"aoti", b"tensorrt" or b"megakernel".
ENGINE = "zerokv.engine"
# The method the delegate belongs to, for errors that name it.
METHOD = "zerokv.method"
# b"1" when the caller-owned caches the delegate writes in place are elided from its outputs.
ZERO_COPY_KV = "zerokv.zero_copy_kv"
# Where the delegate's named data (weights, plans) goes: b"ptd" (a data file beside the .pte, tagged
# NAMED_DATA_TAG) or b"pte" (the .pte's own named data segment).
NAMED_DATA = "zerokv.named_data"
NAMED_DATA_PLACES = ("ptd", "pte")
NAMED_DATA_TAG = "zerokv"


def read(compile_specs, key, default=None) -> str | None:
    for spec in compile_specs:
        if spec.key == key:
            value = spec.value
            return value.decode() if isinstance(value, bytes) else str(value)
    return default


def parse_named_data(place: str) -> str:
    """`place` if it is a NAMED_DATA_PLACES value, else ZeroKVError."""
    if place not in NAMED_DATA_PLACES:
        raise ZeroKVError(f"named_data {place!r}: expected one of {list(NAMED_DATA_PLACES)}")
    return place


def parse_device(device: str) -> int:
    """The index N of a "cuda:N" device string."""
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind != "cuda" or not index.isdigit():
        raise ZeroKVError(f"device {device!r}: zerokv delegates run on 'cuda:N'")
    return int(index)
