"""The kernel microbenchmarks' timing: a step captured as one CUDA graph and its replays timed by CUDA
events, so that launch overhead on the host is not in the figure (as in a decode step's graph)."""

import torch


def capture(step):
    """`step` as a CUDA graph, after one run outside the capture that compiles and loads its kernels."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def microseconds_per_replay(graph, replays):
    """The mean of `replays` back-to-back replays, after one more to warm the caches."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays
