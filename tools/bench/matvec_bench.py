"""One token's linear layers alone on a CUDA GPU: zerokv::matvec beside cuBLAS (torch's linear) and
Inductor's lowering with coordinate-descent tuning (a reduction, what the decode bench's engines
used before), over Llama-3.2-1B's weight shapes in bfloat16 (prints a table; not a test):

    bazel run --config=gpu //tools/bench:matvec_bench

Each cell is one CUDA graph of a layer shape's products over LAYERS distinct weights (as in a step,
so that no weight is still in the L2 cache when it is read again), replayed: microseconds per
product and the weight's bytes divided by that time (TB/s). Rows named `zerokv n=N k=K w=W` sweep
the kernel's launch parameters; `zerokv (defaults)` is what the op launches (matvec.config_for).
Two tables follow: a gated MLP's gate and up (zerokv::gated_matvec) and an attention's query, key
and value (zerokv::matvec_siblings), each in one launch against separate products.
"""

import torch

from tools.bench.cuda_graph_timing import capture, microseconds_per_replay
from tools.bench.decode_roofline_model import SHAPES
from zerokv.kernels import matvec as mv

SHAPE = SHAPES["llama-3.2-1b"]
HIDDEN, FFN, VOCAB = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
KV_WIDTH = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
LAYERS = SHAPE["num_hidden_layers"]
# (name, outputs, inputs, weights per graph): the output head is read once per step, and is larger
# than the L2 cache on its own.
PRODUCTS = [("q/o", HIDDEN, HIDDEN, LAYERS), ("k/v", KV_WIDTH, HIDDEN, LAYERS), ("gate/up", FFN, HIDDEN, LAYERS),
            ("down", HIDDEN, FFN, LAYERS), ("lm_head", VOCAB, HIDDEN, 1)]
# Launch parameters to sweep, those whose tile gives each thread 8 to 128 elements: fewer leaves
# its loads narrower than 16 bytes, more spills registers.
SWEEP = [(block_n, block_k, warps) for block_n in (1, 2, 4, 8, 16, 32) for block_k in (256, 512, 1024, 2048, 4096)
         for warps in (4, 8) if 8 <= block_n * block_k // (32 * warps) <= 128]
REPLAYS = 20


def _cell(step, weights, out, x):
    micros = microseconds_per_replay(capture(step), REPLAYS) / len(weights)
    want = x.float() @ weights[-1].float().T
    torch.testing.assert_close((out() if callable(out) else out).float(), want, rtol=2e-2, atol=5e-2)
    return f"{micros:.1f} ({weights[0].numel() * weights[0].element_size() / micros / 1e6:.2f})"


def main():
    import torch._inductor.config

    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; weights in bfloat16")
    columns = [f"{name} [{outputs}, {inputs}]" for name, outputs, inputs, _ in PRODUCTS]
    print("| variant | " + " | ".join(f"{column}: us (TB/s)" for column in columns) + " |")
    print("|---|" + "---:|" * len(PRODUCTS))
    rows = {}
    for name, outputs, inputs, count in PRODUCTS:
        weights = [torch.randn(outputs, inputs, device="cuda", dtype=torch.bfloat16) / inputs ** 0.5
                   for _ in range(count)]
        x = torch.randn(1, inputs, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, outputs, device="cuda", dtype=torch.bfloat16)

        def linear_step():
            for weight in weights:
                torch.mm(x, weight.T, out=out)

        with torch._inductor.config.patch(coordinate_descent_tuning=True):
            compiled = torch.compile(lambda x, weight: torch.nn.functional.linear(x, weight), dynamic=False)
            compiled(x, weights[0])

        inductor_out = []

        def inductor_step():
            inductor_out[:] = [compiled(x, weight) for weight in weights][-1:]

        def zerokv_step(block_n, block_k, warps):
            def step():
                for weight in weights:
                    mv.launch(x, weight, None, out, block_n, block_k, warps)
            return step

        rows.setdefault("cuBLAS (torch linear)", []).append(_cell(linear_step, weights, out, x))
        rows.setdefault("Inductor, coordinate descent", []).append(
            _cell(inductor_step, weights, lambda: inductor_out[0], x))
        rows.setdefault("zerokv (defaults)", []).append(
            _cell(zerokv_step(*mv.config_for(outputs, inputs)), weights, out, x))
        for block_n, block_k, warps in SWEEP:
            rows.setdefault(f"zerokv n={block_n} k={block_k} w={warps}", []).append(
                _cell(zerokv_step(block_n, block_k, warps), weights, out, x))
        del weights
        torch.cuda.empty_cache()
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    _gated()
    _siblings()


def _gated():
    """A gated MLP's gate and up over LAYERS layers: zerokv::gated_matvec (both weights and SiLU in one
    kernel) against two zerokv::matvec and torch's SiLU-times-up."""
    weights = [(torch.randn(FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5,
                torch.randn(FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5) for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    outs = []

    def gated_step():
        outs[:] = [torch.ops.zerokv.gated_matvec(x, gate, up) for gate, up in weights][-1:]

    def separate_step():
        outs[:] = [torch.nn.functional.silu(torch.ops.zerokv.matvec(x, gate, None)) * torch.ops.zerokv.matvec(x, up, None)
                   for gate, up in weights][-1:]

    gate, up = weights[-1]
    want = torch.nn.functional.silu(x.float() @ gate.float().T) * (x.float() @ up.float().T)
    print(f"\n| gate and up [{FFN}, {HIDDEN}] x 2 | us per layer (TB/s) |\n|---|---:|")
    for name, step in (("zerokv::gated_matvec", gated_step), ("2 x zerokv::matvec, then SiLU x up", separate_step)):
        micros = microseconds_per_replay(capture(step), REPLAYS) / LAYERS
        torch.testing.assert_close(outs[0].float(), want, rtol=2e-2, atol=5e-2)
        print(f"| {name} | {micros:.1f} ({2 * gate.numel() * gate.element_size() / micros / 1e6:.2f}) |", flush=True)


def _siblings():
    """An attention's query, key and value over LAYERS layers: zerokv::matvec_siblings (one launch)
    against three zerokv::matvec."""
    rows = (HIDDEN, KV_WIDTH, KV_WIDTH)
    weights = [[torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN ** 0.5 for n in rows]
               for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    outs = []

    def siblings_step():
        outs[:] = [torch.ops.zerokv.matvec_siblings(x, layer, [None] * 3) for layer in weights][-1]

    def separate_step():
        outs[:] = [[torch.ops.zerokv.matvec(x, weight, None) for weight in layer] for layer in weights][-1]

    layer_bytes = sum(weight.numel() * weight.element_size() for weight in weights[-1])
    print(f"\n| query, key, value {list(rows)} x [{HIDDEN}] | us per layer (TB/s) |\n|---|---:|")
    for name, step in (("zerokv::matvec_siblings", siblings_step), ("3 x zerokv::matvec", separate_step)):
        micros = microseconds_per_replay(capture(step), REPLAYS) / LAYERS
        for out, weight in zip(outs, weights[-1]):
            torch.testing.assert_close(out.float(), x.float() @ weight.float().T, rtol=2e-2, atol=5e-2)
        print(f"| {name} | {micros:.1f} ({layer_bytes / micros / 1e6:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
