"""The peers of //tools/bench:decode_roofline on the GPU machine, and the copy bandwidth its roofline
divides by:

    decode_roofline_peers.py OUT.tsv --positions 256,1024,... [--shape llama-3.2-1b] [--max-cache 32768]

Rows (tab-separated): variant, position, median ms, p99 ms, steps. Variants, each a decode step of
the same model with the token from the host and the logits back to it, as zerokv's steps are timed:
  hf_eager               Hugging Face eager, its StaticCache of --max-cache positions;
  hf_compile             torch.compile(mode="reduce-overhead") over the same (the usual fast-generation
                         recipe: CUDA graphs, a static cache);
  hf_compile_tight       the same with a StaticCache sized to the position plus 256: the best a user
                         can do with a static cache (a recompile, and graphs, per size);
  d2d_copy_bandwidth     bytes moved (read + written) per second by a 1 GiB device-to-device copy, in
                         the position column 0 and the GB/s in the median column.
"""

import argparse
import statistics
import sys
import time

import torch

from tools.bench import decode_roofline_model as bench_model
from tools.bench import static_cache

TIGHT_MARGIN = 256


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth_gbs(device, size=1 << 30, repeats=20, trials=5):
    """The device-to-device copy's rate in GB/s (bytes read plus written): the best of `trials`
    rounds of `repeats` copies. One round varied by 10% between runs on H100s (2.71-3.02 TB/s),
    and a slow round would make the roofline easier to meet."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    _synchronize(device)
    best = 0.0
    for _ in range(trials):
        started = time.perf_counter()
        for _ in range(repeats):
            target.copy_(source)
        _synchronize(device)
        best = max(best, 2 * size * repeats / (time.perf_counter() - started) / 1e9)
    return best


def time_steps(forward, cache, position, warmup, steps, vocab, model_device):
    """Per-step milliseconds of `steps` decode steps from `position`, after `warmup` ones. The host's
    side of each copy is page-locked on a CUDA device, as zerokv's programs' host buffers are
    (PinnedPlannedMemory); each step ends synchronized, so the next may write them again."""
    static_cache.place(cache, position - warmup)
    pinned = torch.device(model_device).type == "cuda"
    token_host = torch.empty((1, 1), dtype=torch.long, pin_memory=pinned)
    position_host = torch.empty((1, 1), dtype=torch.long, pin_memory=pinned)
    logits_host = None
    times = []
    with torch.no_grad():
        for step in range(warmup + steps):
            at = position - warmup + step
            started = time.perf_counter()
            token_host.fill_(at * 7 % vocab)
            position_host.fill_(at)
            token = token_host.to(model_device, non_blocking=True)
            positions = position_host.to(model_device, non_blocking=True)
            logits = forward(input_ids=token, position_ids=positions, past_key_values=cache, use_cache=True).logits
            if logits_host is None:
                logits_host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=pinned)
            logits_host.copy_(logits, non_blocking=True)
            if pinned:
                torch.cuda.synchronize(model_device)
            times.append((time.perf_counter() - started) * 1e3)
    if int(cache.layers[0].cumulative_length) != position + steps:
        raise SystemExit(f"the StaticCache is at {int(cache.layers[0].cumulative_length)} after decoding to "
                         f"{position + steps}: the steps did not write where the bench placed them")
    return times[warmup:]


def row(out, variant, position, times):
    times = sorted(times)
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    out.write(f"{variant}\t{position}\t{statistics.median(times):.4f}\t{p99:.4f}\t{len(times)}\n")
    out.flush()
    print(f"{variant} at {position}: median {statistics.median(times):.3f} ms, p99 {p99:.3f} ms", file=sys.stderr,
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--positions", required=True)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(bench_model.SHAPES))
    parser.add_argument("--max-cache", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cpu: only to test the bench's own code")
    args = parser.parse_args()
    positions = [int(position) for position in args.positions.split(",")]
    model = bench_model.build(args.shape, device=args.device)
    vocab, device = model.config.vocab_size, args.device
    with open(args.out, "w") as out:
        out.write(f"d2d_copy_bandwidth\t0\t{copy_bandwidth_gbs(device):.1f}\t0\t0\n")
        cache = static_cache.allocated(model, args.max_cache)
        for position in positions:
            row(out, "hf_eager", position, time_steps(model, cache, position, 3, min(args.steps, 16), vocab, device))
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for position in positions:
            row(out, "hf_compile", position, time_steps(compiled, cache, position, 5, args.steps, vocab, device))
        del cache
        for position in positions:
            tight = static_cache.allocated(model, position + TIGHT_MARGIN)
            row(out, "hf_compile_tight", position, time_steps(compiled, tight, position, 5, args.steps, vocab, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
