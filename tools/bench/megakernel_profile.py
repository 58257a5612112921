"""Where the persistent decode step's time goes, on a CUDA GPU (a diagnostic, not a test).

    python3 tools/bench/megakernel_profile.py OUT_DIR [--positions 256,16384] [--baseline CHECKOUT]...
        [--variants default,trace]

Builds the kernel of cc/engines/megakernel with nvcc in variants and times each, graph-captured, at
each position over the Llama-3.2-1B-shaped model of the bench:
  <checkout>     with --baseline (once or more), the kernel of another checkout (its
                 cc/engines/megakernel sources), named by its folder, timed in the same run on the same card;
  default        as built without defines;
  ring<N>        the shared-memory ring at N tiles (ZEROKV_MEGAKERNEL_RING);
  split_tiles<N> attention split at N tiles a work item at least (ZEROKV_MEGAKERNEL_SPLIT_TILES);
  no_grid_sync   the grid barriers taken out (wrong results): what the tile stream alone costs;
  trace          every CTA's global time at each barrier's arrival and departure, summarized per
                 stage: the work between barriers, the wait in them, and how far apart CTAs arrive;
                 and the share of a stage's cycles its first consumer thread waited for tiles
                 (starved: the stream is behind) and its producer waited for free slots (blocked:
                 the consumers are behind); how long the first consumer thread took for the stage's
                 input, for its tiles and for what follows them, on average and in each layer's
                 slowest CTA; and which CTAs are slowest in each stage, on average
                 over the layers, with how alike two layers' per-CTA times are (the same SMs slow).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "py")]  # the repository's modules and the zerokv package, without Bazel
from cc.engines.megakernel import llama_decode_step as megakernel  # noqa: E402
import decode_roofline_model as bench_model  # noqa: E402
import decode_roofline_peers as peers  # noqa: E402
from cuda_graph_timing import capture, microseconds_per_replay  # noqa: E402

STAGES = ["qkv", "attention", "o_proj", "gate_up", "down"]
VARIANTS = {"default": [], "ring8": ["ZEROKV_MEGAKERNEL_RING=8"], "ring4": ["ZEROKV_MEGAKERNEL_RING=4"],
            "split_tiles4": ["ZEROKV_MEGAKERNEL_SPLIT_TILES=4"],
            "no_grid_sync": ["ZEROKV_MEGAKERNEL_NO_GRID_SYNC"], "trace": ["ZEROKV_MEGAKERNEL_TRACE"]}
# TraceField's order in llama_decode_step.cu (trace_layout checks the count, not the order).
TRACE_FIELDS = ["arrive_ns", "leave_ns", "arrive_clock", "leave_clock", "starved", "blocked", "input_clock",
                "tiles_clock"]
ARRIVE_NS, LEAVE_NS, ARRIVE_CLOCK, LEAVE_CLOCK, STARVED, BLOCKED, INPUT_CLOCK, TILES_CLOCK = range(len(TRACE_FIELDS))


def trace_layout(lib):
    """The trace's (ctas, barriers, fields, barriers a layer), as the library reports them."""
    values = [ctypes.c_int() for _ in range(4)]
    lib.zerokv_megakernel_trace_layout(*[ctypes.byref(v) for v in values])
    ctas, barriers, fields, per_layer = (v.value for v in values)
    if per_layer != len(STAGES) or fields != len(TRACE_FIELDS):
        raise RuntimeError(f"the library's trace has {per_layer} stages a layer and {fields} fields, this reader "
                           f"{len(STAGES)} and {len(TRACE_FIELDS)}")
    return ctas, barriers, fields, per_layer


def read_trace(lib):
    """The kernel's trace as [ctas, barriers, fields], and its cursor reset for the next launch."""
    ctas, barriers, fields, _ = trace_layout(lib)
    trace = (ctypes.c_uint64 * (ctas * barriers * fields))()
    counts = (ctypes.c_int * ctas)()
    lib.zerokv_megakernel_trace.restype = ctypes.c_int
    if lib.zerokv_megakernel_trace(trace, counts) != 0:
        raise RuntimeError("reading the trace failed")
    return torch.tensor(list(trace), dtype=torch.float64).view(ctas, barriers, fields)


def summarize_trace(lib, layers, position):
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    per_layer = len(STAGES)  # trace_layout holds it equal to the library's
    fields = read_trace(lib)[:ctas, :layers * per_layer]
    arrive, leave = fields[..., ARRIVE_NS] / 1e3, fields[..., LEAVE_NS] / 1e3  # us
    arrive_clock, leave_clock = fields[..., ARRIVE_CLOCK], fields[..., LEAVE_CLOCK]
    starved, blocked = fields[..., STARVED], fields[..., BLOCKED]
    cycles = (arrive_clock[:, 1:] - leave_clock[:, :-1]).clamp(min=1)  # the stage after barrier b-1, per CTA
    work = arrive[:, 1:] - leave[:, :-1]  # the stage after barrier b-1, per CTA
    us_per_cycle = (work / cycles).median().item()
    # The stage's marks, kept only where this launch wrote them (a CTA without attention work writes none).
    input_at, tiles_at = fields[:, 1:, INPUT_CLOCK], fields[:, 1:, TILES_CLOCK]
    marked = (leave_clock[:, :-1] <= input_at) & (input_at <= tiles_at) & (tiles_at <= arrive_clock[:, 1:])
    parts = {"input": input_at - leave_clock[:, :-1], "tiles": tiles_at - input_at, "after": arrive_clock[:, 1:] - tiles_at}
    wait = leave - arrive
    spread = arrive.max(0).values - arrive.min(0).values
    total = (leave.max() - leave[:, 0].min()).item()
    print(f"trace at {position}: {total:.1f} us from the first barrier's departure to the last's", flush=True)
    for k, stage in enumerate(STAGES):
        # stage k runs between barrier (per_layer l + k - 1) and (per_layer l + k): work index per_layer l + k - 1
        idx = [per_layer * l + k - 1 for l in range(layers) if per_layer * l + k - 1 >= 0]
        w = work[:, idx]
        ends = [i + 1 for i in idx]  # the barriers that end the stage
        print(f"  {stage:9s}: work mean {w.mean().item():6.2f} us, slowest CTA {w.max(0).values.mean().item():6.2f} us; "
              f"barrier wait mean {wait[:, ends].mean().item():6.2f} us; arrival spread "
              f"{spread[ends].mean().item():6.2f} us (per layer); starved {(starved[:, ends] / cycles[:, idx]).mean().item():.0%}, "
              f"blocked {(blocked[:, ends] / cycles[:, idx]).mean().item():.0%}", flush=True)
        m = marked[:, idx]
        slowest_cta, layer = w.argmax(0), torch.arange(len(idx))
        if m[slowest_cta, layer].any():
            mean = ", ".join(f"{part} {(v[:, idx][m].float().mean() * us_per_cycle).item():.2f}" for part, v in parts.items())
            slow = ", ".join(f"{part} {(v[:, idx][slowest_cta, layer][m[slowest_cta, layer]].float().mean() * us_per_cycle).item():.2f}"
                             for part, v in parts.items())
            print(f"             first consumer thread, us: {mean} (mean over {m.float().mean().item():.0%} of CTA-layers); "
                  f"in the slowest CTA: {slow}", flush=True)
        # Whether the same CTAs (one per SM, so the same SMs) are the slow ones in every layer: the
        # CTAs slowest on average, and how alike two layers' per-CTA times are.
        per_cta = w.mean(1)
        slowest = per_cta.argsort(descending=True)[:4].tolist()
        alike = torch.corrcoef(w.T)
        pairs = alike[~torch.eye(alike.shape[0], dtype=torch.bool)]
        print(f"             slowest CTAs on average {', '.join(f'{c} ({per_cta[c].item():.2f} us)' for c in slowest)};"
              f" per-CTA times' correlation between layers {pairs.nanmean().item():.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--positions", default="256,16384")
    parser.add_argument("--baseline", action="append", default=[], help="a checkout whose kernel to time beside this one's")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which of " + ", ".join(VARIANTS))
    args = parser.parse_args()
    names = args.variants.split(",")
    if unknown := [name for name in names if name not in VARIANTS]:
        parser.error(f"no variant {', '.join(unknown)}: the variants are {', '.join(VARIANTS)}")
    for baseline in args.baseline:
        if not all(os.path.isfile(os.path.join(baseline, s)) for s in megakernel.SOURCES):
            parser.error(f"--baseline {baseline}: not a checkout with {' and '.join(megakernel.SOURCES)}")
    baselines = {os.path.basename(os.path.normpath(b)): ([], os.path.abspath(b)) for b in args.baseline}
    if len(baselines) < len(args.baseline) or set(baselines) & set(names):
        parser.error(f"--baseline {' '.join(args.baseline)}: the checkouts' folder names must differ from each other "
                     f"and from the variants'")
    os.makedirs(args.out, exist_ok=True)
    positions = [int(p) for p in args.positions.split(",")]
    model = bench_model.build("llama-3.2-1b", device="cuda")
    config = model.config
    capacity = max(positions) + 64
    shape = (config.num_key_value_heads, capacity, config.head_dim)
    keys = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(config.num_hidden_layers)]
    values = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(config.num_hidden_layers)]
    bandwidth = peers.copy_bandwidth_gbs("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s; roofline " + ", ".join(
        f"{(bench_model.weight_bytes(model) + bench_model.kv_bytes_per_position(model) * (p + 1)) / bandwidth / 1e3:.1f}"
        f" us at {p}" for p in positions), flush=True)
    variants = {**baselines, **{name: (VARIANTS[name], megakernel.ROOT) for name in names}}
    first_logits = {}  # the first variant's at each position, which the others' are compared with
    for name, (defines, root) in variants.items():
        lib = megakernel.load(megakernel.build_with_nvcc(
            os.path.join(args.out, f"libzerokv_megakernel_{name}.so"), defines, root))
        step = megakernel.LlamaDecodeStep(lib, model, keys, values)
        step.token.fill_(5)
        for position in positions:
            step.position.fill_(position)
            if name.startswith("trace"):
                read_trace(lib)  # resets the cursor
                step.launch()
                torch.cuda.synchronize()
                print(name, end=" ")
                summarize_trace(lib, config.num_hidden_layers, position)
                continue
            graph = capture(step.launch)
            replays = [microseconds_per_replay(graph, 100) for _ in range(3)]
            logits = step.logits.float()
            first = first_logits.setdefault(position, (name, logits.clone()))
            agreement = "" if first[0] == name else (
                f"; logits' cosine to {first[0]}'s {torch.nn.functional.cosine_similarity(logits, first[1], dim=0).item():.6f}"
                f", top-1 {'same' if int(logits.argmax()) == int(first[1].argmax()) else 'differs'}")
            print(f"{name}\t{position}\t{statistics.median(replays):.1f} us per step{agreement}", flush=True)
        del step


if __name__ == "__main__":
    main()
