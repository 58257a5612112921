"""The table and the plot of //tools/bench:decode_roofline, from its measurements:

    decode_roofline_report.py DIR OUT_DIR

DIR/model.json (decode_roofline_programs.py), DIR/zerokv.tsv (decode_roofline.cc) and DIR/peers.tsv
(decode_roofline_peers.py) -> the Markdown table on stdout and in OUT_DIR/decode_roofline.md, and
the plot OUT_DIR/decode_roofline.png. The roofline at a position is the bytes a step there must read
(every weight once, and K and V of every committed position) over the device-to-device copy
bandwidth measured in the same run.
"""

import collections
import json
import os
import sys

DECODERS = [  # (variant, column): the per-step medians, fastest zerokv first
    ("zerokv_megakernel", "zerokv megakernel"),
    ("zerokv_static", "zerokv static zero-copy"),
    ("zerokv_runtime_owned", "zerokv runtime-owned"),
    ("zerokv_staged", "zerokv staged"),
    ("bare_engine", "bare engine"),
    ("bare_engine_host_io", "bare engine, host I/O"),
    ("hf_eager", "HF eager"),
    ("hf_compile", "HF compile"),
    ("hf_compile_tight", "HF compile, tight cache"),
]
ZEROKV = ("zerokv_megakernel", "zerokv_static", "zerokv_runtime_owned")
# The variants over runtime-owned caches, timed at every step from position 0 (growth steps included).
RUNTIME_OWNED = (("zerokv_runtime_owned", "zerokv runtime-owned"), ("zerokv_megakernel", "zerokv megakernel"))
PEERS = ("hf_eager", "hf_compile", "hf_compile_tight")


def read_rows(*paths):
    """{variant: {position: (median, p99, steps)}}"""
    rows = collections.defaultdict(dict)
    for path in paths:
        with open(path) as table:
            for line in table:
                variant, position, median, p99, steps = line.split("\t")
                rows[variant][int(position)] = (float(median), float(p99), int(steps))
    return rows


def roofline_ms(model, position, bandwidth_gbs):
    return (model["weight_bytes"] + model["kv_bytes_per_position"] * (position + 1)) / (bandwidth_gbs * 1e6)


def _between_growths(position, growths):
    """Where `position` lies between the steps that grew the caches."""
    before = [growth for growth in growths if growth < position]
    after = [growth for growth in growths if growth > position]
    places = ([f"{position - before[-1]} steps after the growth at {before[-1]}"] if before else []) + \
             ([f"{after[0] - position} before the growth at {after[0]}"] if after else [])
    return ", ".join(places) or "with no growth in the run"


def measured_positions(rows):
    """The positions any zerokv variant was timed at."""
    return sorted(set().union(*(rows[variant] for variant in ZEROKV if variant in rows)))


def table(model, rows):
    bandwidth = rows["d2d_copy_bandwidth"][0][0]
    positions = measured_positions(rows)
    lines = ["| position | roofline | " + " | ".join(column for _, column in DECODERS) +
             " | best zerokv / roofline | best peer / best zerokv |",
             "| ---: " * (len(DECODERS) + 4) + "|"]
    for position in positions:
        roof = roofline_ms(model, position, bandwidth)
        cells = [f"{rows[variant][position][0]:.3f}" if position in rows.get(variant, {}) else "—"
                 for variant, _ in DECODERS]
        best = min(rows[variant][position][0] for variant in ZEROKV if position in rows.get(variant, {}))
        peer = min((rows[variant][position][0] for variant in PEERS if position in rows.get(variant, {})),
                   default=float("nan"))
        lines.append(f"| {position} | {roof:.3f} | " + " | ".join(cells) + f" | {best / roof:.2f}x | {peer / best:.2f}x |")
    lines.append("")
    lines.append("p99 ms per position (median in parentheses):")
    lines.append("")
    for variant, column in DECODERS:
        if variant in rows:
            lines.append(f"- {column}: " + ", ".join(
                f"{position}: {p99:.3f} ({median:.3f})" for position, (median, p99, _) in sorted(rows[variant].items())))
    for prefix, name in RUNTIME_OWNED:
        if prefix + "_all" in rows:
            median, p99, steps = rows[prefix + "_all"][0]
            lines.append(f"- {name}, every step from position 0: {steps} steps, median {median:.3f}, p99 {p99:.3f}")
        for suffix, steps in (("_growth", "steps that grew the caches"), ("_after_growth", "steps right after a growth"),
                              ("_without_growth", "steps that did not grow them")):
            if prefix + suffix in rows:
                median, slowest, count = rows[prefix + suffix][0]
                lines.append(f"- {name}, the {count} {steps}: median {median:.3f}, slowest {slowest:.3f}")
        growths = sorted(rows.get(prefix + "_growth_step", {}))
        host = rows.get(prefix + "_slow_step_host", {})
        for position, (ms, _, _) in sorted(rows.get(prefix + "_slow_step", {}).items()):
            lines.append(f"- {name}, a step over twice the median that did not grow the caches: "
                         f"{ms:.3f} ms at position {position}, {_between_growths(position, growths)}"
                         + (f"; meanwhile the runner's thread {_host_events(*host[position])}" if position in host
                            else ""))
    for variant in sorted(v for v in rows if v.startswith("agreement_")):
        cosine, matches, steps = rows[variant][0]
        lines.append(f"- {variant[len('agreement_'):]} against Hugging Face eager over positions 0-{steps - 1}: "
                     f"min cosine {cosine:.6f}, top-1 equal at {int(matches)} of {steps}")
    for variant in sorted(v for v in rows if v.startswith("cuda_graph_replays_")):
        replays, _, steps = rows[variant][0]
        lines.append(f"- {variant[len('cuda_graph_replays_'):]}: {int(replays)} CUDA graph replays in {steps} steps")
    if "dependent_launch_edges" in rows:
        edges, _, graphs = rows["dependent_launch_edges"][0]
        lines.append(f"- dependent launch: {int(edges)} kernel-to-kernel edges made programmatic in {graphs} "
                     f"captured graphs")
    lines.append(f"- device-to-device copy: {bandwidth:.0f} GB/s (read + written); weights "
                 f"{model['weight_bytes'] / 1e9:.3f} GB, KV {model['kv_bytes_per_position']} bytes per position")
    return "\n".join(lines) + "\n"


def _host_events(involuntary_switches, page_faults, moved):
    """What the operating system did to the runner's thread during a step (decode_roofline.cc's `_host` rows)."""
    return (f"had {int(involuntary_switches)} involuntary context switches and {int(page_faults)} page faults, and "
            + ("moved to another CPU" if moved else "stayed on one CPU"))


def plot(model, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    bandwidth = rows["d2d_copy_bandwidth"][0][0]
    positions = measured_positions(rows)
    figure, axes = pyplot.subplots(figsize=(8, 5))
    axes.plot(positions, [roofline_ms(model, p, bandwidth) for p in positions], "k--", label="roofline")
    for variant, column in DECODERS:
        if variant in rows and variant != "zerokv_staged":
            points = sorted(rows[variant].items())
            axes.plot([p for p, _ in points], [v[0] for _, v in points], marker="o", label=column)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("position")
    axes.set_ylabel("ms per decode step (median)")
    axes.set_title(f"{model['shape']} bf16 decode step, cache max {model['max_cache']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    directory, out = sys.argv[1], sys.argv[2]
    with open(os.path.join(directory, "model.json")) as file:
        model = json.load(file)
    rows = read_rows(os.path.join(directory, "zerokv.tsv"), os.path.join(directory, "peers.tsv"))
    text = table(model, rows)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode_roofline.md"), "w") as file:
        file.write(text)
    plot(model, rows, os.path.join(out, "decode_roofline.png"))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
