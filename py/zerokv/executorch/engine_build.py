"""What an engine kind's module (aoti_engine, tensorrt_engine) builds with: the result of a build,
the error that refuses one, the blob dtype of a binding and the check of its engine options.

It sits below engines.py, which holds the engine kinds, so that their modules need not import it.
"""

from __future__ import annotations

from zerokv.aoti import EngineBuild  # EngineBuild: payload, bindings, aliased_io, named data
from zerokv.blob.torch_dtypes import BLOB_DTYPES
from zerokv.errors import ZeroKVError

__all__ = ["EngineBuild", "EngineBuildError", "blob_dtype", "check_option_names"]


class EngineBuildError(ZeroKVError, RuntimeError):
    """The engine could not be built for a delegate; the message names the delegate and why."""


def blob_dtype(dtype, what: str):
    try:
        return BLOB_DTYPES[dtype]
    except KeyError:
        raise EngineBuildError(f"{what}: dtype {dtype} has no zerokv blob encoding") from None


def check_option_names(engine: str, options, known):
    """Refuses engine_options that are not a dict of `known` names (ZeroKVError naming the option)."""
    if not isinstance(options, dict):
        raise ZeroKVError(f"engine_options: expected a dict of {engine} engine options {sorted(known)}, "
                          f"got {type(options).__name__}")
    unknown = sorted(set(options) - set(known), key=str)
    if unknown:
        raise ZeroKVError(f"engine_options: unknown option {', '.join(map(repr, unknown))} for engine {engine!r}; "
                          f"known: {sorted(known)}")
