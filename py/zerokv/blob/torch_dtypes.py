"""The torch dtype of each blob DType: the one pairing of the two, which every torch-side module
(zerokv.aoti, zerokv.executorch, zerokv.tensorrt) reads.

A DType is named after its torch dtype (DType.BFLOAT16 is torch.bfloat16, and TensorRT's
trt.bfloat16), so the pairing is read off the schema rather than listed again. zerokv.blob itself
stays torch-free: this module is a Bazel target of its own.
"""

import torch

from zerokv.blob import DType


def type_name(dtype: DType) -> str:
    """What torch and TensorRT call `dtype`: its name in lower case."""
    return dtype.name.lower()


TORCH_DTYPES = {dtype: getattr(torch, type_name(dtype)) for dtype in DType}
BLOB_DTYPES = {torch_dtype: dtype for dtype, torch_dtype in TORCH_DTYPES.items()}
