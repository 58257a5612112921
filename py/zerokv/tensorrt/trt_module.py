"""Imports the TensorRT Python API: full TensorRT where installed, else TensorRT-RTX.

Both expose the same network-definition API for what zerokv builds. TensorRT-RTX
ships as two wheels whose import names differ from the metapackage's: the
libraries must be loaded (`tensorrt_rtx_libs`) before the bindings import.
"""

import functools
import importlib
from types import ModuleType


class TensorRTUnavailableError(ImportError):
    """Neither TensorRT nor TensorRT-RTX can be imported."""


@functools.cache
def import_tensorrt() -> ModuleType:
    """The `tensorrt` module, or TensorRT-RTX's bindings under the same API."""
    failures = []
    try:
        return importlib.import_module("tensorrt")
    except ImportError as error:
        failures.append(f"tensorrt: {error}")
    try:
        importlib.import_module("tensorrt_rtx_libs")
        return importlib.import_module("tensorrt_rtx_bindings")
    except ImportError as error:
        failures.append(f"tensorrt_rtx_libs + tensorrt_rtx_bindings: {error}")
    raise TensorRTUnavailableError(
        "no TensorRT Python API could be imported (" + "; ".join(failures) + ")"
    )


def flavor() -> str:
    """'tensorrt' or 'tensorrt_rtx', naming which API `import_tensorrt` returned."""
    return "tensorrt_rtx" if import_tensorrt().__name__.startswith("tensorrt_rtx") else "tensorrt"
