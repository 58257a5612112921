"""zerokv::flash_decode's and zerokv::matvec's kernels (matvec, gated_matvec, matvec_siblings) compile for the
H200 (sm_90) on any machine: Triton lowers them to PTX and its bundled ptxas assembles them, no GPU needed. The
interpreter (flash_decode_test, matvec_test) checks what they compute but not their types: a scale that Inductor
passes as float64 once changed a loop-carried value's type, which only the compiler refuses. The PTX also shows
what a kernel does before its wait for the kernel before it (zerokv.kernels.dependent_launch), which the
interpreter does not run, and Inductor's analysis of a kernel's IR which arguments it writes. Compiled kernels
take no CPU tensors: the operator refuses them by name."""

import ast
import os
import re
import subprocess

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the compiler, not the interpreter, is under test", allow_module_level=True)

import triton  # noqa: E402  (the venv pins it)
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from zerokv.kernels import dependent_launch  # noqa: E402
from zerokv.kernels import flash_decode as fd  # noqa: E402
from zerokv.kernels import matvec as mv  # noqa: E402
from zerokv.kernels.kernel_test_device import H200, an_h200_for_triton  # noqa: E402

LLAMA_1B = {"SPLITS": 64, "GROUP": 4, "BLOCK_G": 16, "HEAD_DIM": 64}


@pytest.fixture(autouse=True)
def _fresh_triton_cache(tmp_path, monkeypatch):
    # A cached kernel would not be compiled again; and the sandbox's home is read-only.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))


def _compile(kernel, types, constants, num_warps):
    """Compiles `kernel` with argument types `types` (by name; integers default to `types["int"]`).
    Every pointer and integer is taken as a multiple of 16, as the launch specializes the
    tensors and sizes of the models' shapes, so that the loads are the vector loads a GPU runs."""
    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constants else types.get(name, types["int"])
    aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
               if signature[name] != "constexpr" and signature[name][0] in "*i"}
    source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=H200, options={"num_warps": num_warps})


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("scale", ["fp32", "fp64"])  # Inductor passes a Python float as float64
@pytest.mark.parametrize("integers", ["i32", "i64"])  # strides and sizes past 2**31 arrive as i64
@pytest.mark.parametrize("stages", [1, 3])  # the while loop, and the pipelined one
def test_the_split_kernel_compiles_for_the_h200(dtype, scale, integers, stages):
    compiled = _split(dtype, scale, integers, dependent_launch=True, stages=stages)
    assert ".entry _split_kernel" in compiled.asm["ptx"]


def test_a_pipelined_sweep_keeps_tiles_in_flight():
    """Pipelined, the sweep issues the next tiles' loads asynchronously (cp.async) before it waits
    for this one's; the while loop loads each tile when it gets to it."""
    assert "cp.async" in _split("bf16", "fp32", "i32", True, stages=3).asm["ptx"]
    assert "cp.async" not in _split("bf16", "fp32", "i32", True, stages=1).asm["ptx"]


def _split(dtype, scale, integers, dependent_launch, stages=fd.STAGES):
    types = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "partial_out": "*fp32", "partial_max": "*fp32",
             "partial_sum": "*fp32", "Position": "*i64", "scale": scale, "int": integers}
    # The head dimension's strides are 1, which the launch specializes (and the pipelined loop's
    # asynchronous copies need: runs of contiguous elements).
    return _compile(fd._split_kernel, types,
                    {**LLAMA_1B, "BLOCK_N": fd.BLOCK_N, "DEPENDENT_LAUNCH": dependent_launch, "STAGES": stages,
                     "stride_qd": 1, "stride_kd": 1, "stride_vd": 1}, num_warps=4)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_combine_kernel_compiles_for_the_h200(dtype):
    compiled = _combine(dtype, dependent_launch=True)
    assert ".entry _combine_kernel" in compiled.asm["ptx"]


def _combine(dtype, dependent_launch):
    types = {"partial_out": "*fp32", "partial_max": "*fp32", "partial_sum": "*fp32", "Out": f"*{dtype}", "int": "i32"}
    return _compile(fd._combine_kernel, types, {**LLAMA_1B, "DEPENDENT_LAUNCH": dependent_launch}, num_warps=1)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("inputs", [2048, 100])  # whole blocks of columns, and a partial one
@pytest.mark.parametrize("integers", ["i32", "i64"])
@pytest.mark.parametrize("bias, gated", [(True, False), (False, False), (False, True)])
def test_the_matvec_kernel_compiles_for_the_h200(dtype, inputs, integers, bias, gated):
    compiled = _matvec(dtype, inputs, integers, bias, gated, dependent_launch=True)
    assert ".entry _matvec_kernel" in compiled.asm["ptx"]


def _matvec(dtype, inputs, integers, bias, gated, dependent_launch, constant_weights=True):
    types = {"X": f"*{dtype}", "W": f"*{dtype}", "Up": f"*{dtype}", "Bias": f"*{dtype}", "Y": f"*{dtype}",
             "int": integers}
    block_n, block_k, num_warps = mv.config_for(2048, inputs)
    return _compile(mv._matvec_kernel, types,
                    {"K": inputs, "GATED": gated, "HAS_BIAS": bias, "BLOCK_N": block_n, "BLOCK_K": block_k,
                     "EVEN_K": inputs % block_k == 0, "DEPENDENT_LAUNCH": dependent_launch,
                     "CONSTANT_WEIGHTS": constant_weights}, num_warps)


@pytest.mark.parametrize("inputs, gated", [(2048, False), (2048, True), (8192, False)])
def test_the_1b_products_keep_their_registers(inputs, gated, tmp_path):
    """Llama-3.2-1B's products at their launch parameters: query, key, value, output and head (rows of
    2048), gate and up, and down (rows of 8192). A spilled register goes to local memory and back in
    the loop that streams the weights."""
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(_matvec("bf16", inputs, "i32", False, gated, True).asm["ptx"])
    target = re.search(r"^\.target (\w+)", ptx.read_text(), re.MULTILINE).group(1)
    report = subprocess.run([get_ptxas(H200.arch).path, "-v", f"--gpu-name={target}", str(ptx), "-o",
                             str(tmp_path / "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and spills.groups() == ("0", "0"), report


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("integers", ["i32", "i64"])
@pytest.mark.parametrize("biases", [(False, False, False), (True, True, True), (True, False, True)])
def test_the_siblings_kernel_compiles_for_the_h200(dtype, integers, biases):
    compiled = _siblings(dtype, integers, biases, dependent_launch=True)
    assert ".entry _siblings_kernel" in compiled.asm["ptx"]


def _siblings(dtype, integers, biases, dependent_launch, constant_weights=True):
    types = {name: f"*{dtype}" for name in ("X", "W0", "W1", "W2", "B0", "B1", "B2", "Y0", "Y1", "Y2")}
    block_n, block_k, num_warps = mv.config_for(512, 2048)
    return _compile(mv._siblings_kernel, {**types, "int": integers},
                    {"K": 2048, **{f"HAS_BIAS{i}": bias for i, bias in enumerate(biases)}, "BLOCK_N": block_n,
                     "BLOCK_K": block_k, "EVEN_K": True, "DEPENDENT_LAUNCH": dependent_launch,
                     "CONSTANT_WEIGHTS": constant_weights}, num_warps)


def _accesses(ptx):
    """[(global load, store or asynchronous copy, whether every path to it from the kernel's entry
    passes a griddepcontrol.wait)] over the kernel's PTX: its blocks and branches, to a fixed point."""
    # One per statement (an inline assembly puts several on a line), the predicate of a
    # conditional one (`@%p1 ld.global...`, `@%p1 bra ...`) kept apart.
    statements = []
    for line in ptx.splitlines():
        for statement in line.split(";"):
            statement = statement.split("//")[0].strip()
            if statement.startswith("$L") and ":" in statement:
                label, statement = statement.split(":", 1)
                statements.append(("label", label.strip()))
                statement = statement.strip()
            if statement:
                predicated = statement.startswith("@")
                statements.append(("predicated" if predicated else "always",
                                   statement.split(None, 1)[1] if predicated else statement))
    blocks, block = [], []
    for kind, statement in statements:
        if kind == "label" and block:
            blocks.append(block)
            block = []
        block.append((kind, statement))
        if statement.startswith(("bra", "ret")):
            blocks.append(block)
            block = []
    blocks.append(block)
    blocks = [block for block in blocks if block]
    starts = {statement: index for index, block in enumerate(blocks)
              for kind, statement in block[:1] if kind == "label"}
    successors = []
    for index, block in enumerate(blocks):
        kind, last = block[-1]
        following = [index + 1] if index + 1 < len(blocks) else []
        if last.startswith("bra"):
            target = [starts[last.split()[-1]]]
            successors.append(target + following if kind == "predicated" else target)
        else:
            successors.append([] if last.startswith("ret") else following)

    def waited_after(index, waited):
        return waited or any(statement.startswith("griddepcontrol.wait") for _, statement in blocks[index])

    waited_in = [index != 0 for index in range(len(blocks))]  # must-analysis: all paths
    changed = True
    while changed:
        changed = False
        for index in range(len(blocks)):
            for successor in successors[index]:
                if waited_in[successor] and not waited_after(index, waited_in[index]):
                    waited_in[successor] = False
                    changed = True
    accesses = []
    for index, block in enumerate(blocks):
        waited = waited_in[index]
        for _, statement in block:
            waited = waited or statement.startswith("griddepcontrol.wait")
            # cp.async.{ca,cg}.shared.global: a pipelined loop's loads ahead, into shared memory.
            if statement.startswith(("ld.global", "st.global", "cp.async.ca.shared.global",
                                     "cp.async.cg.shared.global")):
                accesses.append((statement, waited))
    return accesses


def test_the_kernels_that_may_launch_early_are_these():
    kernels = (mv._matvec_kernel, mv._siblings_kernel, fd._split_kernel, fd._combine_kernel)
    assert set(dependent_launch.KERNELS) == {kernel.__name__ for kernel in kernels}


@pytest.mark.parametrize("kernel", ["matvec", "down", "gated", "bias", "partial columns", "siblings"])
def test_a_product_of_constant_weights_reads_only_its_first_weights_before_its_wait(kernel):
    """No kernel writes the program's constants, so loading them early is safe; x and the bias are
    not read, and no output written, before the kernel before has completed. The weights' loads are
    the ones that evict first."""
    compiled = {"matvec": lambda: _matvec("bf16", 2048, "i32", False, False, True),
                "down": lambda: _matvec("bf16", 8192, "i32", False, False, True),
                "gated": lambda: _matvec("bf16", 2048, "i32", False, True, True),
                "bias": lambda: _matvec("bf16", 2048, "i32", True, False, True),
                "partial columns": lambda: _matvec("bf16", 100, "i64", True, True, True),
                "siblings": lambda: _siblings("bf16", "i32", (True, False, True), True)}[kernel]()
    accesses = _accesses(compiled.asm["ptx"])
    early = [access for access, waited in accesses if not waited]
    assert early and all(access.startswith("ld.global") and "evict_first" in access for access in early)
    assert any(access.startswith("ld.global") and "evict_first" not in access for access, _ in accesses)  # x
    assert any(access.startswith("st.global") for access, _ in accesses)


@pytest.mark.parametrize("kernel", ["split", "pipelined split", "combine", "matvec", "gated", "siblings"])
def test_attention_and_other_products_read_nothing_before_their_wait(kernel):
    """Attention reads what the kernels before write; a product's weights may be computed in the
    step unless zerokv.kernels.constant_weights marked them."""
    compiled = {"split": lambda: _split("bf16", "fp64", "i32", True),
                "pipelined split": lambda: _split("bf16", "fp64", "i32", True, stages=3),
                "combine": lambda: _combine("bf16", True),
                "matvec": lambda: _matvec("bf16", 2048, "i32", True, False, True, constant_weights=False),
                "gated": lambda: _matvec("bf16", 8192, "i32", False, True, True, constant_weights=False),
                "siblings": lambda: _siblings("bf16", "i32", (True, False, True), True, constant_weights=False),
                }[kernel]()
    accesses = _accesses(compiled.asm["ptx"])
    assert accesses and all(waited for _, waited in accesses)


@pytest.fixture
def _an_h200_for_triton():
    with an_h200_for_triton():
        yield


@pytest.mark.parametrize("dependent_launch, constant_weights", [(False, False), (True, False), (True, True)])
def test_inductor_sees_each_kernel_write_its_outputs_only(_an_h200_for_triton, dependent_launch, constant_weights):
    """What Inductor takes a user kernel to write, it copies before every launch. An inline assembly
    it cannot analyze (an impure one, as Triton's own gdc_wait) makes it take every argument as
    written: on the H200 the 1B decode step copied its weights and took 2.5 times as long."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    def written(kernel, **kwargs):
        accesses = identify_accessed_tensors(kernel, {**kwargs, "DEPENDENT_LAUNCH": dependent_launch}, {})
        return sorted(dependency.name for dependency in accesses.read_writes.writes)

    bf16, fp32 = torch.bfloat16, torch.float32
    x, weight, y = torch.empty(2048, dtype=bf16), torch.empty(8192, 2048, dtype=bf16), torch.empty(8192, dtype=bf16)
    assert written(mv._matvec_kernel, X=x, W=weight, Up=weight, Bias=y, Y=y, N=8192, stride_wn=2048, stride_un=2048,
                   K=2048, GATED=True, HAS_BIAS=False, BLOCK_N=2, BLOCK_K=1024, EVEN_K=True,
                   CONSTANT_WEIGHTS=constant_weights) == ["Y"]
    assert written(mv._siblings_kernel, X=x, W0=weight, W1=weight, W2=weight, B0=y, B1=y, B2=y, Y0=y, Y1=y, Y2=y,
                   N0=2048, N1=512, N2=512, stride0=2048, stride1=2048, stride2=2048, K=2048, HAS_BIAS0=False,
                   HAS_BIAS1=False, HAS_BIAS2=False, BLOCK_N=2, BLOCK_K=1024, EVEN_K=True,
                   CONSTANT_WEIGHTS=constant_weights) == ["Y0", "Y1", "Y2"]
    query, cache = torch.empty(1, 32, 1, 64, dtype=bf16), torch.empty(1, 8, 4096, 64, dtype=bf16)
    partial, rows = torch.empty(64 * 8 * 16, 64, dtype=fp32), torch.empty(64 * 8 * 16, dtype=fp32)
    for stages in (1, 3):  # the while loop, and the pipelined one
        assert written(fd._split_kernel, Q=query, K=cache, V=cache, partial_out=partial, partial_max=rows,
                       partial_sum=rows, Position=torch.empty(1, dtype=torch.int64), capacity=4096, kv_heads=8,
                       stride_qb=2048, stride_qh=64, stride_qd=1, stride_kb=2097152, stride_kh=262144, stride_kn=64,
                       stride_kd=1, stride_vb=2097152, stride_vh=262144, stride_vn=64, stride_vd=1, scale=0.125,
                       **LLAMA_1B, BLOCK_N=fd.BLOCK_N, STAGES=stages) == ["partial_max", "partial_out", "partial_sum"]
    out = torch.empty(1, 1, 32, 64, dtype=bf16)
    assert written(fd._combine_kernel, partial_out=partial, partial_max=rows, partial_sum=rows, Out=out, kv_heads=8,
                   stride_ob=2048, stride_oh=64, stride_od=1, **LLAMA_1B) == ["Out"]


def test_each_kernels_source_survives_inductors_copy_of_it():
    """Inductor copies a user kernel's source, with every function it calls, into a string literal
    of the Python module it generates; an escape such as a newline in an inline assembly's text
    became a line break inside a string there, and the module failed to import on the H200."""
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    for kernel in (mv._matvec_kernel, mv._siblings_kernel, fd._split_kernel, fd._combine_kernel):
        source = user_defined_triton_kernel_transitive_closure_source_code(kernel)
        assert "def wait_for_the_kernel_before" in source
        compile(ast.literal_eval("'''" + source + "'''"), kernel.__name__, "exec")


def test_without_dependent_launch_a_kernel_has_no_wait():
    for compiled in (_matvec("bf16", 2048, "i32", False, True, False), _siblings("bf16", "i32", (False,) * 3, False),
                     _split("bf16", "fp32", "i32", False), _combine("bf16", False)):
        assert "griddepcontrol" not in compiled.asm["ptx"]


@pytest.mark.parametrize("kernel", ["matvec", "matvec, computed weights", "siblings", "split", "combine"])
def test_the_wait_leaves_the_loads_as_they_were(kernel):
    """The 0 the wait returns is added to addresses; unless it is known to keep their alignment,
    vector loads become loads of one element (K and V's tiles in attention)."""
    compile_with = {"matvec": lambda wait: _matvec("bf16", 2048, "i32", True, True, wait),
                    "matvec, computed weights": lambda wait: _matvec("bf16", 2048, "i32", True, True, wait, False),
                    "siblings": lambda wait: _siblings("bf16", "i32", (True, False, True), wait),
                    "split": lambda wait: _split("bf16", "fp64", "i32", wait),
                    "combine": lambda wait: _combine("bf16", wait)}[kernel]

    def loads(compiled):  # each load's kind (width, vector, cache hints), not its registers
        return sorted(line.split("ld.global", 1)[1].split(" ", 1)[0]
                      for line in compiled.asm["ptx"].splitlines() if "ld.global" in line)

    assert loads(compile_with(True)) == loads(compile_with(False))


def test_without_the_interpreter_cpu_tensors_are_refused_by_name():
    query = torch.zeros(1, 4, 1, 16, dtype=torch.float16)
    key = torch.zeros(1, 2, 8, 16, dtype=torch.float16)
    with pytest.raises(fd.FlashDecodeError, match="flash_decode: the kernels run on CUDA devices, .* not on cpu"):
        torch.ops.zerokv.flash_decode(query, key, key, torch.tensor([3]), 0.25)
    with pytest.raises(mv.MatvecError, match="matvec: the kernel runs on CUDA devices, .* not on cpu"):
        torch.ops.zerokv.matvec(torch.zeros(8), torch.zeros(4, 8), None)
    with pytest.raises(mv.MatvecError, match="matvec_siblings: the kernel runs on CUDA devices, .* not on cpu"):
        torch.ops.zerokv.matvec_siblings(torch.zeros(8), [torch.zeros(4, 8)] * 2, [None] * 2)
