"""The exported program loaded by ExecuTorch's runtime with zerokv's C++ backend: the MEGAKERNEL
engine takes the blob Python wrote (its settings, constants, bindings and the runtime's KV manifest)
and refuses it only for want of a GPU. On a GPU machine export_gpu_test runs it."""

import ctypes
import os

import pytest
import torch

BACKEND = ctypes.CDLL(os.environ["ZEROKV_BACKEND_HOST_DEVICE_SO"], os.RTLD_GLOBAL)
import zerokv.executorch as zx  # noqa: E402  (the backend must be registered first)
from zerokv.megakernel.export import export_decode  # noqa: E402
from zerokv.megakernel.testing import small_model  # noqa: E402



@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the engine loads: export_gpu_test decodes with it")
def test_the_engine_takes_the_exported_blob_up_to_the_device(tmp_path, capfd):
    model = small_model()
    program, runtime_kv = export_decode(model, max_capacity=64, initial_capacity=16)
    path = str(tmp_path / "decode.pte")
    zx.save(zx.export({"decode": program}, engine="megakernel", runtime_kv=runtime_kv), path)
    with pytest.raises(RuntimeError):
        zx.load_program(path).load_method("decode")
    log = capfd.readouterr().err
    assert "megakernel: selecting CUDA device 0" in log, log
