"""Decode attention alone on a CUDA GPU: zerokv::flash_decode beside ExecuTorch's split-K decode kernel
(`triton::sdpa_decode_splitk`, the kernel it replaced), over Llama-3.2-1B's heads (32 query, 8 KV, head
size 64, bfloat16) and static caches of CAPACITY positions (prints a table; not a test):

    bazel run --config=gpu //tools/bench:flash_decode_bench -- [COMMITTED...]

Each row is one CUDA graph of LAYERS layers' attention (each layer its own caches, as in a step),
replayed with COMMITTED positions in the caches (the step at position COMMITTED - 1); microseconds
per layer, and the KV bytes the committed positions hold divided by that time. Rows named
`zerokv stages=T splits=S block_n=N warps=W` sweep the kernel's launch parameters around its
defaults (flash_decode.STAGES, splits_for, BLOCK_N, 4 warps).
"""

import sys

import torch

from tools.bench.cuda_graph_timing import capture, microseconds_per_replay
from tools.bench.decode_roofline_model import SHAPES
from zerokv.kernels import flash_decode as fd

SHAPE = SHAPES["llama-3.2-1b"]
QUERY_HEADS, KV_HEADS, HEAD_DIM = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
LAYERS = SHAPE["num_hidden_layers"]
CAPACITY = 32768
# Multiples of the splits' tiles and one past them: the 1B step at position 4096 commits 4097, where
# one split reads a tile more than the others.
COMMITTED = [256, 1024, 4096, 4097, 8192, 8193, 16384, 16385]
REPLAYS = 50


def main():
    import executorch.backends.cuda.triton.kernels  # noqa: F401  (registers torch.ops.triton.*)

    committed_lengths = [int(argument) for argument in sys.argv[1:]] or COMMITTED
    torch.manual_seed(0)
    query = torch.randn(1, QUERY_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    caches = [(torch.randn(1, KV_HEADS, CAPACITY, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(1, KV_HEADS, CAPACITY, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    position = torch.zeros(1, dtype=torch.long, device="cuda")
    out = torch.empty(1, 1, QUERY_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    default_splits = fd.splits_for(KV_HEADS, multiprocessors)

    def executorch_step():
        for key, value in caches:
            torch.ops.triton.sdpa_decode_splitk(query, key, value, None, 0.0, False, scale, True, kv_len=position + 1)

    def zerokv_step(splits, block_n, warps, stages=fd.STAGES):
        def step():
            for key, value in caches:
                fd.launch(query, key, value, position, scale, out, splits, block_n=block_n, num_warps=warps,
                          stages=stages)
        return step

    variants = {"executorch sdpa_decode_splitk": executorch_step,
                "zerokv (defaults)": zerokv_step(default_splits, fd.BLOCK_N, 4)}
    for stages in sorted({1, 2, 3, 4} - {fd.STAGES}):
        variants[f"zerokv stages={stages}"] = zerokv_step(default_splits, fd.BLOCK_N, 4, stages)
    for splits in (default_splits // 2, default_splits * 2):
        variants[f"zerokv splits={splits}"] = zerokv_step(splits, fd.BLOCK_N, 4)
    for block_n, warps in ((32, 2), (64, 2), (128, 4), (128, 8)):
        variants[f"zerokv block_n={block_n} warps={warps}"] = zerokv_step(default_splits, block_n, warps)

    key, value = caches[-1]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {LAYERS} layers per graph, capacity {CAPACITY}")
    print("| variant | " + " | ".join(f"{n} committed: us/layer (TB/s)" for n in committed_lengths) + " |")
    print("|---|" + "---:|" * len(committed_lengths))
    for name, step in variants.items():
        graph = capture(step)
        cells = []
        for committed in committed_lengths:
            position.fill_(committed - 1)
            micros = microseconds_per_replay(graph, REPLAYS) / LAYERS
            kv_bytes = 2 * KV_HEADS * committed * HEAD_DIM * 2
            if name.startswith("zerokv"):  # the last layer's output, against SDPA at this position
                group = QUERY_HEADS // KV_HEADS
                want = torch.nn.functional.scaled_dot_product_attention(
                    query.float(), key[:, :, :committed].float().repeat_interleave(group, 1),
                    value[:, :, :committed].float().repeat_interleave(group, 1), scale=scale).transpose(1, 2)
                torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
            cells.append(f"{micros:.1f} ({kv_bytes / micros / 1e6:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
