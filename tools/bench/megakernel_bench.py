"""The persistent decode-step kernel (cc/engines/megakernel) on a CUDA GPU, beside the roofline.

    python3 tools/bench/megakernel_bench.py OUT_DIR [--positions 256,1024,...] [--define MACRO=VALUE ...]

On the GPU machine (torch, transformers and nvcc; no ExecuTorch or Bazel needed): builds the kernel
with nvcc into OUT_DIR (or takes --library, as Bazel built it), builds the bench's
Llama-3.2-1B-shaped model (decode_roofline_model.py), then
  1. checks the step against transformers' own decode step over a StaticCache holding random history,
     at positions that start, fill and cross attention tiles and splits, both measured against the
     float32 step: logits (cosine, top-1) and the K and V rows written, all layers, and that no
     other row changed; a position outside the cache or a token outside the vocabulary must write
     no cache row, leave every logit NaN and set the step's error word (llama_decode_step.py's
     checks). Exits 1 on any mismatch;
  2. times the step captured as one CUDA graph, 64 steps from each position (tab-separated rows on
     stdout and in OUT_DIR/megakernel.tsv, as decode_roofline's):
       megakernel_step    the token and position copied in from page-locked host memory, the graph
                          replayed, the logits copied back, synchronized (as zerokv_static's step);
       megakernel_graph   the replay and a synchronize alone (as bare_engine);
       megakernel_gpu     the mean of 200 back-to-back replays by CUDA events (median column);
       roofline           weights plus the KV of positions [0, position], over the copy bandwidth
                          measured in this run (d2d_copy_bandwidth, GB/s, as the peers measure it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "py")]  # the repository's modules and the zerokv package, without Bazel
from cc.engines.megakernel import llama_decode_step as megakernel  # noqa: E402
import decode_roofline_model as bench_model
import decode_roofline_peers as peers
from tools.bench import static_cache  # noqa: E402
from cuda_graph_timing import capture, microseconds_per_replay

CHECK_POSITIONS = [0, 1, 63, 64, 65, 200, 1000, 1023, 1025, 4097, 9000]


def time_step(step, graph, position, steps, warmup, vocab):
    token_host = torch.empty((), dtype=torch.long, pin_memory=True)
    position_host = torch.empty((), dtype=torch.long, pin_memory=True)
    logits_host = torch.empty(step.logits.shape, dtype=step.logits.dtype, pin_memory=True)
    full, replay_only = [], []
    for index in range(warmup + steps):
        at = position - warmup + index
        started = time.perf_counter()
        token_host.fill_(at * 7 % vocab)
        position_host.fill_(at)
        step.token.copy_(token_host, non_blocking=True)
        step.position.copy_(position_host, non_blocking=True)
        graph.replay()
        logits_host.copy_(step.logits, non_blocking=True)
        torch.cuda.synchronize()
        full.append((time.perf_counter() - started) * 1e3)
    step.position.fill_(position)
    torch.cuda.synchronize()
    for _ in range(warmup + steps):
        started = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        replay_only.append((time.perf_counter() - started) * 1e3)
    return full[warmup:], replay_only[warmup:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--positions", default="256,1024,4096,8192,16384")
    parser.add_argument("--max-cache", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--library", help="a built libzerokv_megakernel.so (default: nvcc builds one in OUT_DIR)")
    parser.add_argument("--define", action="append", default=[],
                        help="a macro for that build, e.g. ZEROKV_MEGAKERNEL_RING=4 (repeatable)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.library and args.define:
        raise SystemExit("--define builds the kernel; --library takes one built")
    lib = megakernel.load(args.library or megakernel.build_with_nvcc(
        os.path.join(args.out, "libzerokv_megakernel.so"), args.define))
    model = bench_model.build("llama-3.2-1b", device="cuda")
    config = model.config
    cache = static_cache.allocated(model, args.max_cache)
    torch.manual_seed(1)
    for layer in cache.layers:  # history the step attends over: random, the same in both caches
        layer.keys.normal_()
        layer.values.normal_()
    keys = [layer.keys[0].clone() for layer in cache.layers]
    values = [layer.values[0].clone() for layer in cache.layers]
    step = megakernel.LlamaDecodeStep(lib, model, keys, values)
    reference = megakernel.float32_reference(model, cache)
    failures = megakernel.check_against_transformers(model, step, cache, keys, values, CHECK_POSITIONS, reference,
                                                     report=lambda line: print(line, file=sys.stderr, flush=True))
    del reference
    failures += megakernel.check_refusals(step, keys, values)
    for failure in failures:
        print(f"MISMATCH {failure}", file=sys.stderr)
    del cache
    torch.cuda.empty_cache()

    positions = [int(p) for p in args.positions.split(",")]
    bandwidth = peers.copy_bandwidth_gbs("cuda")
    weights = bench_model.weight_bytes(model)
    per_position = bench_model.kv_bytes_per_position(model)
    step.position.fill_(positions[0])
    graph = capture(step.launch)
    with open(os.path.join(args.out, "megakernel.tsv"), "w") as out:
        def row(variant, position, times):
            times = sorted(times)
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            line = f"{variant}\t{position}\t{statistics.median(times):.4f}\t{p99:.4f}\t{len(times)}"
            print(line, flush=True)
            out.write(line + "\n")

        row("d2d_copy_bandwidth", 0, [bandwidth])
        for position in positions:
            full, replay_only = time_step(step, graph, position, args.steps, 8, config.vocab_size)
            row("megakernel_step", position, full)
            row("megakernel_graph", position, replay_only)
            step.position.fill_(position)
            row("megakernel_gpu", position, [microseconds_per_replay(graph, 200) / 1e3])
            roofline = (weights + per_position * (position + 1)) / (bandwidth * 1e6)
            row("roofline", position, [roofline])
            print(f"at {position}: step {statistics.median(full):.3f} ms, graph {statistics.median(replay_only):.3f} "
                  f"ms, roofline {roofline:.3f} ms: {statistics.median(full) / roofline:.2f}x", file=sys.stderr,
                  flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
