"""zerokv::flash_decode's and zerokv::matvec's kernels (matvec, gated_matvec, matvec_siblings) compile for the H200 (sm_90) on any machine: Triton lowers them to
PTX and its bundled ptxas assembles them, no GPU needed. The interpreter (flash_decode_test, matvec_test) checks
what they compute but not their types: a scale that Inductor passes as float64 once changed a
loop-carried value's type, which only the compiler refuses. Compiled kernels take no CPU tensors:
the operator refuses them by name."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the compiler, not the interpreter, is under test", allow_module_level=True)

import triton  # noqa: E402  (the venv pins it)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from zerokv.kernels import flash_decode as fd  # noqa: E402
from zerokv.kernels import matvec as mv  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
LLAMA_1B = {"SPLITS": 64, "GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 64}


@pytest.fixture(autouse=True)
def _fresh_triton_cache(tmp_path, monkeypatch):
    # A cached kernel would not be compiled again; and the sandbox's home is read-only.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))


def _compile(kernel, types, constants, num_warps):
    """Compiles `kernel` with argument types `types` (by name; integers default to `types["int"]`)."""
    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constants else types.get(name, types["int"])
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=H200, options={"num_warps": num_warps})


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("scale", ["fp32", "fp64"])  # Inductor passes a Python float as float64
@pytest.mark.parametrize("integers", ["i32", "i64"])  # strides and sizes past 2**31 arrive as i64
def test_the_split_kernel_compiles_for_the_h200(dtype, scale, integers):
    types = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "partial_out": "*fp32", "partial_max": "*fp32",
             "partial_sum": "*fp32", "Position": "*i64", "scale": scale, "int": integers}
    compiled = _compile(fd._split_kernel, types, {**LLAMA_1B, "BLOCK_N": fd.BLOCK_N}, num_warps=4)
    assert ".entry _split_kernel" in compiled.asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_combine_kernel_compiles_for_the_h200(dtype):
    types = {"partial_out": "*fp32", "partial_max": "*fp32", "partial_sum": "*fp32", "Out": f"*{dtype}", "int": "i32"}
    compiled = _compile(fd._combine_kernel, types, LLAMA_1B, num_warps=1)
    assert ".entry _combine_kernel" in compiled.asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("inputs", [2048, 100])  # whole blocks of columns, and a partial one
@pytest.mark.parametrize("integers", ["i32", "i64"])
@pytest.mark.parametrize("bias, gated", [(True, False), (False, False), (False, True)])
def test_the_matvec_kernel_compiles_for_the_h200(dtype, inputs, integers, bias, gated):
    types = {"X": f"*{dtype}", "W": f"*{dtype}", "Up": f"*{dtype}", "Bias": f"*{dtype}", "Y": f"*{dtype}",
             "int": integers}
    block_n, block_k, num_warps = mv.config_for(2048, inputs)
    compiled = _compile(mv._matvec_kernel, types, {"K": inputs, "GATED": gated, "HAS_BIAS": bias, "BLOCK_N": block_n,
                                                   "BLOCK_K": block_k, "EVEN_K": inputs % block_k == 0}, num_warps)
    assert ".entry _matvec_kernel" in compiled.asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("integers", ["i32", "i64"])
@pytest.mark.parametrize("biases", [(False, False, False), (True, True, True), (True, False, True)])
def test_the_siblings_kernel_compiles_for_the_h200(dtype, integers, biases):
    types = {name: f"*{dtype}" for name in ("X", "W0", "W1", "W2", "B0", "B1", "B2", "Y0", "Y1", "Y2")}
    block_n, block_k, num_warps = mv.config_for(512, 2048)
    compiled = _compile(mv._siblings_kernel, {**types, "int": integers},
                        {"K": 2048, **{f"HAS_BIAS{i}": bias for i, bias in enumerate(biases)}, "BLOCK_N": block_n,
                         "BLOCK_K": block_k, "EVEN_K": True}, num_warps)
    assert ".entry _siblings_kernel" in compiled.asm["ptx"]


def test_without_the_interpreter_cpu_tensors_are_refused_by_name():
    query = torch.zeros(1, 4, 1, 16, dtype=torch.float16)
    key = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    with pytest.raises(fd.FlashDecodeError, match="flash_decode: the kernels run on CUDA devices, .* not on cpu"):
        torch.ops.zerokv.flash_decode(query, key, key, torch.tensor([3]), 0.25)
    with pytest.raises(mv.MatvecError, match="matvec: the kernel runs on CUDA devices, .* not on cpu"):
        torch.ops.zerokv.matvec(torch.zeros(8), torch.zeros(4, 8), None)
    with pytest.raises(mv.MatvecError, match="matvec_siblings: the kernel runs on CUDA devices, .* not on cpu"):
        torch.ops.zerokv.matvec_siblings(torch.zeros(8), [torch.zeros(4, 8)] * 2, [None] * 2)
