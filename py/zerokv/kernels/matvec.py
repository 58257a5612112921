"""One token's linear layers, `x @ weight.T + bias`, read at the memory's bandwidth.

`torch.ops.zerokv.matvec(x, weight, bias)` takes `x` [..., K] holding one row (a decode step of one
token), `weight` [N, K] as nn.Linear stores it, and an optional `bias` [N]; it returns [..., N] in
x's dtype, accumulated in float32. Two more ops read one x in one launch:
`gated_matvec(x, gate_weight, up_weight)` returns SiLU(x gate^T) * (x up^T), a gated MLP's input to
its down projection, and `matvec_siblings(x, weights, biases)` returns 2 or 3 products (an
attention's query, key and value; zerokv.kernels.sibling_matvecs groups them in a graph). They are
`torch.library.triton_op`s, so AOTInductor compiles their kernels into the engine like its own.
On sm_90 and later they wait for the kernel before them (zerokv.kernels.dependent_launch) before
they read x; with `constant_weights=True` (zerokv.kernels.constant_weights sets it where the weights
are the program's constants) their programs load their first tile of the weights before that wait,
and otherwise they read nothing before it.

Why: a one-token step reads every weight once and does two flops per weight read, so its matrix
products are bound by the memory's bandwidth. Inductor lowers them as reductions (with
coordinate-descent tuning) or to cuBLAS. Alone, Inductor's reduction reads most large weights about
as fast as this kernel, though its tuning varies between compiles (//tools/bench:matvec_bench: gate
and up's [8192, 2048] took 9.8 us in one run and 17.6 in the next, against 9.2; K and V's [512,
2048] 3.0 against 2.3), but in a decoder it takes in the pointwise work that makes its input (the RMS norm's scaling,
SiLU(gate) * up) and does it again for every row of the weight: on the H200 the down projection
that computes SiLU(gate) * up took 13.3 us (results/h200/profile_ab_torch_linear.md) and 19.3 us in
another compile (profile.md at 745c90e), against 9.6 alone. The input of a `triton_op` is a tensor,
so Inductor computes it once, before. cuBLAS was slower than both on every shape but the output
head. Each program reads BLOCK_N whole rows of the weight, BLOCK_K columns at
a time, once and contiguously; `x` (a few KiB) stays in the cache.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction

from zerokv.kernels import dependent_launch
from zerokv.kernels.grid_dependency import wait_for_the_kernel_before
from zerokv.kernels.matvec_contract import DTYPES, MAX_SIBLINGS, MatvecError, is_one_row

# Launch parameters: rows per program, columns per load, warps. On the H200, over Llama-3.2-1B's
# shapes in bfloat16, 2 rows of 1024 columns with 4 warps was the best or within 5% of it for every
# shape among loads of up to 1024 columns (//tools/bench:matvec_bench, results/h200/matvec_bench.md):
# [8192, 2048] in 9.2 us (3.6 TB/s), [2048, 8192] in 9.8, [2048, 2048] in 3.9, [512, 2048] in 2.2.
BLOCK_N = 2
BLOCK_K = 1024
NUM_WARPS = 4
# Rows longer than two loads of BLOCK_K (the down projection's 8192) load LONG_BLOCK_K columns at a
# time on LONG_NUM_WARPS. With every program of such a product on the machine at once, what is in
# flight is one load of BLOCK_K columns per row, too little for the memory's latency; and that
# kernel spilled registers. Under programmatic launch on the H200, 16 of [2048, 8192] took 10.5 us
# each at 1024 columns on 4 warps, 9.6 at 2048 on 8, 8.9 at 4096 on 8 (3.75 TB/s) and 10.0 at the
# whole row on 8. In the 1B step the bare engine was 2-3% faster (results/h200/long_rows_ab_f09e968.md).
LONG_BLOCK_K = 4096
LONG_NUM_WARPS = 8


@triton.jit
def _rows(X, W, Up, Bias, Y, N, stride_wn, stride_un, block, K: tl.constexpr, GATED: tl.constexpr,
          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
          DEPENDENT_LAUNCH: tl.constexpr, CONSTANT_WEIGHTS: tl.constexpr):
    """Rows block * BLOCK_N.. of x W^T + bias or, GATED, of SiLU(x W^T) * (x Up^T)."""
    # What the kernel before may have written is read after the wait for it
    # (zerokv.kernels.dependent_launch): x, and the weights unless they are the program's constants.
    if DEPENDENT_LAUNCH and not CONSTANT_WEIGHTS:
        after_the_wait = wait_for_the_kernel_before()
        X += after_the_wait
        W += after_the_wait
        Up += after_the_wait
        Bias += after_the_wait
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    inside_rows = rows < N
    columns = tl.arange(0, BLOCK_K)
    # In 64 bits: an output head of 2**31 elements or more (a vocabulary of 262144 over a hidden
    # size of 8192) would wrap in 32.
    row_starts = W + rows.to(tl.int64)[:, None] * stride_wn
    up_row_starts = Up + rows.to(tl.int64)[:, None] * stride_un
    # Constant weights' first tile is loaded before the wait, so that it streams while the kernel
    # before ends. It is multiplied last, so that the loop's loads are issued while it is on its way.
    if EVEN_K:
        first_mask = inside_rows[:, None]
    else:
        first_mask = inside_rows[:, None] & (columns < K)[None, :]
    first_tile = tl.load(row_starts + columns[None, :], mask=first_mask, other=0.0, eviction_policy="evict_first")
    if GATED:
        up_first_tile = tl.load(up_row_starts + columns[None, :], mask=first_mask, other=0.0,
                                eviction_policy="evict_first")
    if DEPENDENT_LAUNCH and CONSTANT_WEIGHTS:
        X += wait_for_the_kernel_before()
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for start in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            mask = inside_rows[:, None]
            x = tl.load(X + start + columns)
        else:
            inside_columns = start + columns < K
            mask = inside_rows[:, None] & inside_columns[None, :]
            x = tl.load(X + start + columns, mask=inside_columns, other=0.0)
        w = tl.load(row_starts + start + columns[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        if GATED:
            up = tl.load(up_row_starts + start + columns[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
            up_acc += up.to(tl.float32) * x.to(tl.float32)[None, :]
    if EVEN_K:
        x = tl.load(X + columns)
    else:
        x = tl.load(X + columns, mask=columns < K, other=0.0)
    acc += first_tile.to(tl.float32) * x.to(tl.float32)[None, :]
    if GATED:
        up_acc += up_first_tile.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(Bias + rows, mask=inside_rows, other=0.0).to(tl.float32)
    if GATED:  # rounded once
        y = y / (1.0 + tl.exp(-y)) * tl.sum(up_acc, axis=1)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=inside_rows)


@triton.jit
def _matvec_kernel(X, W, Up, Bias, Y, N, stride_wn, stride_un, K: tl.constexpr, GATED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   DEPENDENT_LAUNCH: tl.constexpr, CONSTANT_WEIGHTS: tl.constexpr):
    _rows(X, W, Up, Bias, Y, N, stride_wn, stride_un, tl.program_id(0), K, GATED, HAS_BIAS, BLOCK_N, BLOCK_K, EVEN_K,
          DEPENDENT_LAUNCH, CONSTANT_WEIGHTS)


@triton.jit
def _siblings_kernel(X, W0, W1, W2, B0, B1, B2, Y0, Y1, Y2, N0, N1, N2, stride0, stride1, stride2,
                     K: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, HAS_BIAS2: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     DEPENDENT_LAUNCH: tl.constexpr, CONSTANT_WEIGHTS: tl.constexpr):
    """Up to three products of one x in one launch: the programs are the first product's blocks
    of rows, then the second's, then the third's (N2 0 when there are two)."""
    block = tl.program_id(0)
    first = tl.cdiv(N0, BLOCK_N)
    second = first + tl.cdiv(N1, BLOCK_N)
    if block < first:
        _rows(X, W0, W0, B0, Y0, N0, stride0, stride0, block, K, False, HAS_BIAS0, BLOCK_N, BLOCK_K, EVEN_K,
              DEPENDENT_LAUNCH, CONSTANT_WEIGHTS)
    elif block < second:
        _rows(X, W1, W1, B1, Y1, N1, stride1, stride1, block - first, K, False, HAS_BIAS1, BLOCK_N, BLOCK_K, EVEN_K,
              DEPENDENT_LAUNCH, CONSTANT_WEIGHTS)
    else:
        _rows(X, W2, W2, B2, Y2, N2, stride2, stride2, block - second, K, False, HAS_BIAS2, BLOCK_N, BLOCK_K,
              EVEN_K, DEPENDENT_LAUNCH, CONSTANT_WEIGHTS)


# Triton's interpreter (TRITON_INTERPRET=1 when the kernel was defined) runs it on CPU tensors.
INTERPRETED = isinstance(_matvec_kernel, InterpretedFunction)


def check_inputs(x, weight, bias, up=None, op="matvec"):
    """Raises MatvecError naming what the kernel cannot take (`up`: gated_matvec's second weight)."""
    problems = []
    if not is_one_row(x):
        problems.append(f"x must hold one row ([..., K], one token), not {list(x.shape)}")
    if x.dtype not in DTYPES:
        problems.append(f"x is {x.dtype}; the kernel takes {' or '.join(map(str, DTYPES))}")
    problems += _weight_problems("weight", weight, x)
    if up is not None:
        if up.shape != weight.shape:
            problems.append(f"up's shape {list(up.shape)} is not weight's {list(weight.shape)}")
        else:
            problems += _weight_problems("up", up, x)
    if bias is not None:
        if bias.dim() != 1 or weight.dim() != 2 or bias.shape[0] != weight.shape[0]:
            problems.append(f"bias's shape {list(bias.shape)} is not [N] for weight {list(weight.shape)}")
        problems += _placement_problems("bias", bias, x)
    if problems:
        raise MatvecError(f"{op}: " + "; ".join(problems))


def _weight_problems(name, weight, x):
    if weight.dim() != 2:
        return [f"{name} must be [N, K], not {list(weight.shape)}"]
    if x.dim() and weight.shape[1] != x.shape[-1]:
        return [f"{name}'s shape {list(weight.shape)} does not take x's {x.shape[-1]} inputs"]
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        return [f"{name}'s shape {list(weight.shape)} is empty"]
    if weight.stride(1) != 1 and weight.shape[1] > 1:
        return [f"{name}'s rows must be contiguous (stride {weight.stride()})"]
    return _placement_problems(name, weight, x)


def _placement_problems(name, tensor, x):
    problems = []
    if tensor.dtype != x.dtype:
        problems.append(f"{name} is {tensor.dtype}, x {x.dtype}")
    if tensor.device != x.device:
        problems.append(f"{name} is on {tensor.device}, x on {x.device}")
    return problems


def check_siblings(x, weights, biases):
    """Raises MatvecError naming what matvec_siblings cannot take."""
    if not 2 <= len(weights) <= MAX_SIBLINGS or len(biases) != len(weights):
        raise MatvecError(f"matvec_siblings: 2 to {MAX_SIBLINGS} weights with a bias (or None) each, not "
                          f"{len(weights)} weights and {len(biases)} biases")
    for index, (weight, bias) in enumerate(zip(weights, biases)):
        check_inputs(x, weight, bias, op=f"matvec_siblings: weights[{index}]")


def config_for(outputs: int, inputs: int) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) for a weight of `outputs` rows and `inputs` columns."""
    block_n = min(BLOCK_N, triton.next_power_of_2(outputs))
    if inputs > 2 * BLOCK_K:
        return block_n, LONG_BLOCK_K, LONG_NUM_WARPS
    return block_n, min(BLOCK_K, triton.next_power_of_2(inputs)), NUM_WARPS


def launch(x, weight, bias, out, block_n, block_k, num_warps, up=None, constant_weights=False,
           launcher=lambda kernel: kernel):
    """Runs the kernel into `out` (N elements, contiguous): x W^T + bias or, given `up` (a weight of
    W's shape), SiLU(x W^T) * (x up^T). `constant_weights`: no kernel of the program writes the
    weights or the bias (the ops' argument). `launcher` wraps it (`wrap_triton` when traced);
    //tools/bench:matvec_bench sweeps the launch parameters."""
    _check_blocks(block_n, block_k)
    outputs, inputs = weight.shape
    launcher(_matvec_kernel)[(triton.cdiv(outputs, block_n),)](
        x, weight, weight if up is None else up, weight if bias is None else bias, out, outputs, weight.stride(0),
        weight.stride(0) if up is None else up.stride(0), K=inputs, GATED=up is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=inputs % block_k == 0,
        DEPENDENT_LAUNCH=dependent_launch.supported(x.device), CONSTANT_WEIGHTS=constant_weights, num_warps=num_warps)
    return out


def launch_siblings(x, weights, biases, outs, block_n, block_k, num_warps, constant_weights=False,
                    launcher=lambda kernel: kernel):
    """Runs the siblings kernel: outs[i] (contiguous) = x weights[i]^T + biases[i], 2 or 3 of them."""
    _check_blocks(block_n, block_k)
    slots = [*zip(weights, biases, outs)]
    # A third slot with no rows when there are two: no program reaches it.
    slots += [(weights[-1], biases[-1], outs[-1])] * (MAX_SIBLINGS - len(slots))
    rows = [weight.shape[0] for weight, _, _ in slots[:len(weights)]] + [0] * (MAX_SIBLINGS - len(weights))
    inputs = weights[0].shape[1]
    launcher(_siblings_kernel)[(sum(triton.cdiv(n, block_n) for n in rows),)](
        x, *(weight for weight, _, _ in slots), *(weight if bias is None else bias for weight, bias, _ in slots),
        *(out for _, _, out in slots), *rows, *(weight.stride(0) for weight, _, _ in slots), K=inputs,
        HAS_BIAS0=slots[0][1] is not None, HAS_BIAS1=slots[1][1] is not None, HAS_BIAS2=slots[2][1] is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=inputs % block_k == 0,
        DEPENDENT_LAUNCH=dependent_launch.supported(x.device), CONSTANT_WEIGHTS=constant_weights, num_warps=num_warps)
    return outs


def _check_blocks(block_n, block_k):
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 1 or value & (value - 1):
            raise MatvecError(f"matvec: {name} {value} is not a power of two")


def _check_device(device, op="matvec"):
    if device.type != "cuda" and not INTERPRETED:
        raise MatvecError(f"{op}: the kernel runs on CUDA devices, or on the CPU under Triton's interpreter "
                          f"(TRITON_INTERPRET=1 before it is imported); not on {device}")


@triton_op("zerokv::matvec", mutates_args=())
def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           constant_weights: bool = False) -> torch.Tensor:
    """`constant_weights`: the weight and bias are constants of the program, which none of its
    kernels writes (zerokv.kernels.constant_weights marks the calls where they are)."""
    check_inputs(x, weight, bias)
    _check_device(x.device)
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    return launch(x.contiguous(), weight, None if bias is None else bias.contiguous(), out,
                  *config_for(*weight.shape), constant_weights=constant_weights, launcher=wrap_triton)


@matvec.register_fake
def _(x, weight, bias=None, constant_weights=False):
    check_inputs(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@triton_op("zerokv::gated_matvec", mutates_args=())
def gated_matvec(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                 constant_weights: bool = False) -> torch.Tensor:
    """SiLU(x gate_weight^T) * (x up_weight^T) for one row: a gated MLP's gate and up projections in
    one pass over both weights, and its activation, with no intermediate in memory."""
    check_inputs(x, gate_weight, None, up_weight, op="gated_matvec")
    _check_device(x.device, op="gated_matvec")
    out = x.new_empty((*x.shape[:-1], gate_weight.shape[0]))
    return launch(x.contiguous(), gate_weight, None, out, *config_for(*gate_weight.shape), up=up_weight,
                  constant_weights=constant_weights, launcher=wrap_triton)


@gated_matvec.register_fake
def _(x, gate_weight, up_weight, constant_weights=False):
    check_inputs(x, gate_weight, None, up_weight, op="gated_matvec")
    return x.new_empty((*x.shape[:-1], gate_weight.shape[0]))


@triton_op("zerokv::matvec_siblings", mutates_args=())
def matvec_siblings(x: torch.Tensor, weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]],
                    constant_weights: bool = False) -> list[torch.Tensor]:
    """[x weights[i]^T + biases[i]] for 2 or 3 weights that read the same one-row x: what as many
    matvec calls return, in one launch (zerokv.kernels.sibling_matvecs groups them in a graph)."""
    check_siblings(x, weights, biases)
    _check_device(x.device, op="matvec_siblings")
    outs = [x.new_empty((*x.shape[:-1], weight.shape[0])) for weight in weights]
    block_n = min(config_for(weight.shape[0], weight.shape[1])[0] for weight in weights)
    _, block_k, num_warps = config_for(*weights[0].shape)
    return launch_siblings(x.contiguous(), weights, [None if bias is None else bias.contiguous() for bias in biases],
                           outs, block_n, block_k, num_warps, constant_weights=constant_weights, launcher=wrap_triton)


@matvec_siblings.register_fake
def _(x, weights, biases, constant_weights=False):
    check_siblings(x, weights, biases)
    return [x.new_empty((*x.shape[:-1], weight.shape[0])) for weight in weights]
