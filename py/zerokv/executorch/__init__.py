"""ExecuTorch integration: the zerokv partitioner and backend, and zero-copy KV export."""

from zerokv.errors import ZeroKVError
from zerokv.executorch.api import data_path, export, load_program, save
from zerokv.executorch.backend import ZeroCopyError, ZeroKVBackend
from zerokv.executorch.delegates import ALIASED_BUFFER, BACKEND_ID
from zerokv.executorch.partitioner import ZeroKVPartitioner
from zerokv.executorch.runtime_kv import KVCacheLayer, RuntimeKV, RuntimeKVError
from zerokv.executorch.zero_copy import check_zero_copy_kv

__all__ = [
    "ALIASED_BUFFER",
    "BACKEND_ID",
    "KVCacheLayer",
    "RuntimeKV",
    "RuntimeKVError",
    "ZeroCopyError",
    "ZeroKVBackend",
    "ZeroKVError",
    "ZeroKVPartitioner",
    "check_zero_copy_kv",
    "data_path",
    "export",
    "load_program",
    "save",
]
