"""The torch dtype of each blob DType, and back."""

import torch

from tools.blob_schema import schema
from zerokv.blob import DType
from zerokv.blob.torch_dtypes import BLOB_DTYPES, TORCH_DTYPES, type_name


def test_every_blob_dtype_is_one_torch_dtype_and_back():
    assert set(TORCH_DTYPES) == set(DType)
    assert len(set(TORCH_DTYPES.values())) == len(DType)
    for dtype, torch_dtype in TORCH_DTYPES.items():
        assert isinstance(torch_dtype, torch.dtype)
        assert BLOB_DTYPES[torch_dtype] is dtype


def test_the_pairing_is_by_name():
    assert TORCH_DTYPES[DType.BFLOAT16] is torch.bfloat16 and type_name(DType.BFLOAT16) == "bfloat16"
    assert BLOB_DTYPES[torch.bool] is DType.BOOL
    assert torch.float64 not in BLOB_DTYPES


def test_the_schema_sizes_each_dtype_as_torch_does():
    # The C++ runtime sizes buffers by schema.DTYPE_BYTES (blob_format.h's ElementBytes).
    assert {name: schema.DTYPE_BYTES[name] for name in DType.__members__} == {
        dtype.name: torch_dtype.itemsize for dtype, torch_dtype in TORCH_DTYPES.items()}
