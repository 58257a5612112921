"""Lowers torch.export'ed decoders to TensorRT plans that update KV caches in place.

Public API (used by the ExecuTorch partitioner and `preprocess`): see README.md.
"""

from zerokv.tensorrt.kv_cache import KV_CACHE_UPDATE, KVWriteOutcome, kv_write_alias_decline
from zerokv.tensorrt.lowering import (
    AliasedIO,
    AliasingPromiseError,
    DynamicDim,
    Fallback,
    IOBinding,
    LoweredEngine,
    PlanBuildError,
    TensorRTNetwork,
    build_network,
    lower_to_tensorrt,
)
from zerokv.tensorrt.network import ConversionError
from zerokv.tensorrt.profiles import (
    DimRange,
    Profile,
    ProfileError,
    ResolvedProfile,
    decode_and_prefill_profiles,
)
from zerokv.tensorrt.trt_module import TensorRTUnavailableError, import_tensorrt

__all__ = [
    "KV_CACHE_UPDATE",
    "AliasedIO",
    "AliasingPromiseError",
    "ConversionError",
    "DimRange",
    "DynamicDim",
    "Fallback",
    "IOBinding",
    "KVWriteOutcome",
    "LoweredEngine",
    "PlanBuildError",
    "Profile",
    "ProfileError",
    "ResolvedProfile",
    "TensorRTNetwork",
    "TensorRTUnavailableError",
    "build_network",
    "decode_and_prefill_profiles",
    "import_tensorrt",
    "kv_write_alias_decline",
    "lower_to_tensorrt",
]
