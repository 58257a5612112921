"""The compile specs a zerokv delegate carries (keys; values are UTF-8 bytes)."""

from zerokv.errors import ZeroKVError

# Read by ExecuTorch's PropagateDevicePass: b"cuda:N".
TARGET_DEVICE = "target_device"
# b"aoti" or b"tensorrt".
ENGINE = "zerokv.engine"
# The method the delegate belongs to, for errors that name it.
METHOD = "zerokv.method"
# b"1" when the caller-owned caches the delegate writes in place are elided from its outputs.
ZERO_COPY_KV = "zerokv.zero_copy_kv"


def read(compile_specs, key, default=None) -> str | None:
    for spec in compile_specs:
        if spec.key == key:
            value = spec.value
            return value.decode() if isinstance(value, bytes) else str(value)
    return default


def parse_device(device: str) -> int:
    """The index N of a "cuda:N" device string."""
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind != "cuda" or not index.isdigit():
        raise ZeroKVError(f"device {device!r}: zerokv delegates run on 'cuda:N'")
    return int(index)
