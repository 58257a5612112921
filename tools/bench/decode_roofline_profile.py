"""Where the bench's decode step spends its time, kernel by kernel, on the GPU machine:

    decode_roofline_profile.py OUT [--shape llama-3.2-1b] [--max-cache 32768] [--detail 4096]
                               [--linear matvec|torch] POSITION...

The step is the static-cache program of decode_roofline_programs.py (zerokv's decode kernels,
bfloat16), compiled with the Inductor options and graph pass the zerokv engine uses
(zerokv.aoti.compile.inductor_options with coordinate-descent tuning, sibling one-token products
in one launch) by torch.compile instead of AOTInductor: the same lowering, loaded in Python, where
the PyTorch profiler sees each kernel. It is captured as one CUDA graph and replayed at each POSITION.

Writes OUT (markdown): per position, the graph replay's median ms and the kernels' time per step;
at --detail, every kernel with its launches per step and its time (CUDA events and the profiler on
the replays; the profiler reports each kernel's device time, so the gaps between kernels are the
replay's time minus the kernels' total).
"""

import argparse
import sys
from collections import defaultdict

import torch

from tools.bench import decode_roofline_model as bench_model
from tools.bench.decode_roofline_programs import StaticCacheStep, use_decode_kernels

REPLAYS = 30
PROFILED_REPLAYS = 10


def _step(shape, max_cache, linear):
    model = bench_model.build(shape, device="cuda")
    use_decode_kernels(model, linear)
    step = StaticCacheStep(model, max_cache).cuda().eval()
    return torch.compile(step, fullgraph=True, dynamic=False, backend=_as_the_engine_compiles)


def _as_the_engine_compiles(graph_module, example_inputs):
    """Inductor with the zerokv engine's options and graph passes (zerokv.aoti.compile_aoti). Its
    graph takes the parameters as inputs, so no product is marked as of constant weights, and its
    CUDA graph has no programmatic edges: those are the engine's."""
    from torch._inductor.compile_fx import compile_fx

    from zerokv.aoti.compile import inductor_options
    from zerokv.kernels.constant_weights import mark_constant_weights
    from zerokv.kernels.sibling_matvecs import group_sibling_matvecs

    if group_sibling_matvecs(graph_module.graph) + mark_constant_weights(graph_module.graph):
        graph_module.recompile()
    options = inductor_options(torch.device("cuda"), coordinate_descent_tuning=True)
    return compile_fx(graph_module, example_inputs, config_patches={**options, "triton.cudagraphs": False})


def _graph(compiled, token, position):
    """The step captured as a CUDA graph (after warm-up runs on a side stream, as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled(token, position)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(token, position)
    return graph


def _replay_ms(graph):
    times = []
    for _ in range(REPLAYS):
        started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        graph.replay()
        ended.record()
        ended.synchronize()
        times.append(started.elapsed_time(ended))
    return sorted(times)[len(times) // 2]


def _kernels(graph):
    """{kernel name: (launches per step, device us per step)} over PROFILED_REPLAYS replays."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    totals = defaultdict(lambda: [0, 0.0])
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time
    return {name: (launches / PROFILED_REPLAYS, us / PROFILED_REPLAYS) for name, (launches, us) in totals.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("positions", type=int, nargs="+")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(bench_model.SHAPES))
    parser.add_argument("--max-cache", type=int, default=32768)
    parser.add_argument("--detail", type=int, default=4096)
    parser.add_argument("--linear", default="matvec", choices=["matvec", "torch"],
                        help="the linear layers on zerokv::matvec, or left to Inductor (to measure the kernel)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_roofline_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    compiled = _step(args.shape, args.max_cache, args.linear)
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    position = torch.tensor([args.positions[0]], device="cuda")
    lines = [f"Decode step of {args.shape} over a static cache of {args.max_cache} positions, linear layers on "
             f"{args.linear}, {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| position | graph replay ms | kernels ms | launches |", "| ---: | ---: | ---: | ---: |"]
    detail = None
    with torch.no_grad():
        graph = _graph(compiled, token, position)
        for at in sorted(set(args.positions) | {args.detail}):
            position.fill_(at)
            kernels = _kernels(graph)
            lines.append(f"| {at} | {_replay_ms(graph):.3f} | {sum(us for _, us in kernels.values()) / 1e3:.3f} | "
                         f"{sum(launches for launches, _ in kernels.values()):.0f} |")
            if at == args.detail:
                detail = kernels
    lines += ["", f"Kernels at position {args.detail}, slowest first:", "",
              "| us per step | launches per step | us each | kernel |", "| ---: | ---: | ---: | --- |"]
    for name, (launches, us) in sorted(detail.items(), key=lambda item: -item[1][1]):
        lines.append(f"| {us:.1f} | {launches:g} | {us / launches:.2f} | `{name}` |")
    with open(args.out, "w") as out:
        out.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
