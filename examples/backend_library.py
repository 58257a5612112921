"""Loads zerokv's backend library into the process, for the Python runtime (executorch.runtime)."""

import ctypes
import os

from absl import app


class KVMetrics(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("bytes_reserved", "bytes_in_use", "growths", "bytes_moved", "length", "capacity", "position")]


def load_backend(path: str):
    """Registers zerokv's backend (and its device allocator) with the Python runtime: must run
    before `executorch.runtime` is imported."""
    if not path or not os.path.exists(path):
        raise app.UsageError(f"zerokv backend library not found: {path!r} (run through bazel run, or pass "
                             "--host_backend_library / --cuda_backend_library)")
    library = ctypes.CDLL(os.path.abspath(path), mode=ctypes.RTLD_GLOBAL)
    for counter in ("zerokv_host_to_device_bytes", "zerokv_device_to_host_bytes"):
        getattr(library, counter).restype = ctypes.c_uint64
    library.zerokv_kv_implicit_sequence.restype = ctypes.c_void_p
    library.zerokv_kv_sequence_metrics.argtypes = [ctypes.c_void_p, ctypes.POINTER(KVMetrics)]
    library.zerokv_kv_sequence_release.argtypes = [ctypes.c_void_p]
    return library
