"""The persistent decode-step kernel (cc/engines/megakernel) on a CUDA GPU, beside the roofline.

    python3 tools/bench/megakernel_bench.py OUT_DIR [--positions 256,1024,...]

On the GPU machine (torch, transformers and nvcc; no ExecuTorch or Bazel needed): builds the kernel
with nvcc into OUT_DIR, builds the bench's Llama-3.2-1B-shaped model (decode_roofline_model.py), then
  1. checks the step against transformers' own decode step over a StaticCache holding random history,
     at positions that start, fill and cross attention tiles and splits: logits (cosine, top-1) and
     the K and V rows written, all layers, and that no other row changed; a position at the cache's
     capacity must write nothing and set the step's error word. Exits 1 on any mismatch;
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
import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch

import decode_roofline_model as bench_model
import decode_roofline_peers as peers
from cuda_graph_timing import capture, microseconds_per_replay

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCES = ["cc/engines/megakernel/llama_decode_step.cu", "cc/engines/megakernel/c_api.cc"]
BAD_POSITION = 1  # kBadPosition in llama_decode_step.h
CHECK_POSITIONS = [0, 1, 63, 64, 65, 200, 1000, 1023, 1025, 4097, 9000]


def build_library(out_dir: str) -> ctypes.CDLL:
    library = os.path.join(out_dir, "libzerokv_megakernel.so")
    command = ["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", f"-I{ROOT}",
               *[os.path.join(ROOT, source) for source in SOURCES], "-o", library]
    subprocess.run(command, check=True)
    lib = ctypes.CDLL(library)
    lib.zerokv_megakernel_workspace_bytes.restype = ctypes.c_size_t
    lib.zerokv_megakernel_workspace_bytes.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_size_t]
    lib.zerokv_megakernel_launch.restype = ctypes.c_int
    lib.zerokv_megakernel_launch.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_double, ctypes.c_double,
                                             ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64, ctypes.c_char_p,
                                             ctypes.c_size_t]
    lib.zerokv_megakernel_step_error.restype = ctypes.c_int
    lib.zerokv_megakernel_step_error.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p]
    return lib


def _device_tensor(name, tensor, dtype):
    if not (tensor.is_cuda and tensor.dtype == dtype and tensor.is_contiguous()):
        raise SystemExit(f"{name}: {tensor.dtype} on {tensor.device}, contiguous {tensor.is_contiguous()}; "
                         f"the step needs a contiguous {dtype} CUDA tensor")
    return tensor


class MegakernelStep:
    """One decode step of `model` over the caches `keys` and `values` ([kv_heads, capacity, head_dim]
    per layer), reading `token` and `position` from device scalars and writing `logits`."""

    def __init__(self, lib, model, keys, values):
        config = model.config
        bf16 = torch.bfloat16
        self.lib = lib
        self.shape = (ctypes.c_int64 * 8)(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                          config.num_key_value_heads, config.head_dim, config.intermediate_size,
                                          config.vocab_size, keys[0].shape[1])
        error = ctypes.create_string_buffer(512)
        workspace_bytes = lib.zerokv_megakernel_workspace_bytes(self.shape, error, len(error))
        if workspace_bytes == 0:
            raise SystemExit(error.value.decode())
        self.keep = []
        tensors = []
        for index, layer in enumerate(model.model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).contiguous()
            self.keep.append(qkv)
            tensors += [(f"layers.{index}.input_layernorm", layer.input_layernorm.weight, bf16),
                        (f"layers.{index}.qkv", qkv, bf16),
                        (f"layers.{index}.o_proj", attention.o_proj.weight, bf16),
                        (f"layers.{index}.post_attention_layernorm", layer.post_attention_layernorm.weight, bf16),
                        (f"layers.{index}.gate_proj", mlp.gate_proj.weight, bf16),
                        (f"layers.{index}.up_proj", mlp.up_proj.weight, bf16),
                        (f"layers.{index}.down_proj", mlp.down_proj.weight, bf16),
                        (f"keys[{index}]", keys[index], bf16), (f"values[{index}]", values[index], bf16)]
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float().contiguous()
        self.attention_scaling = float(rotary.attention_scaling)
        self.token = torch.zeros((), dtype=torch.long, device="cuda")
        self.position = torch.zeros((), dtype=torch.long, device="cuda")
        self.logits = torch.zeros(config.vocab_size, dtype=bf16, device="cuda")
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device="cuda")
        tensors += [("embed_tokens", model.model.embed_tokens.weight, bf16), ("norm", model.model.norm.weight, bf16),
                    ("lm_head", model.lm_head.weight, bf16), ("inv_freq", self.inv_freq, torch.float32),
                    ("token", self.token, torch.long), ("position", self.position, torch.long),
                    ("logits", self.logits, bf16), ("workspace", self.workspace, torch.uint8)]
        self.pointers = (ctypes.c_uint64 * len(tensors))(
            *[_device_tensor(name, tensor, dtype).data_ptr() for name, tensor, dtype in tensors])
        self.rms_eps = float(config.rms_norm_eps)

    def launch(self):
        error = ctypes.create_string_buffer(512)
        status = self.lib.zerokv_megakernel_launch(self.shape, self.rms_eps, self.attention_scaling, self.pointers,
                                                   torch.cuda.current_stream().cuda_stream, error, len(error))
        if status != 0:
            raise RuntimeError(f"the megakernel step failed (CUDA error {status}): {error.value.decode()}")

    def error_word(self):
        word = self.lib.zerokv_megakernel_step_error(self.shape, ctypes.c_void_p(self.workspace.data_ptr()))
        if word < 0:
            raise RuntimeError("the step's error word could not be read")
        return word


def check(model, step, cache, keys, values, positions):
    """Mismatches of the step against transformers' at `positions` (ascending), as lines."""
    failures = []
    vocab = model.config.vocab_size
    for position in positions:
        token = (position * 7 + 3) % vocab
        peers._place(cache, position)
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([[token]], device="cuda"),
                             position_ids=torch.tensor([[position]], device="cuda"), past_key_values=cache,
                             use_cache=True).logits[0, -1].float()
        step.token.fill_(token)
        step.position.fill_(position)
        step.launch()
        torch.cuda.synchronize()
        got = step.logits.float()
        cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
        worst = (got - expected).abs().max().item()
        top1 = int(got.argmax()) == int(expected.argmax())
        rows = []
        for index, layer in enumerate(cache.layers):
            for name, ours, theirs in (("K", keys[index], layer.keys[0]), ("V", values[index], layer.values[0])):
                diff = (ours[:, position].float() - theirs[:, position].float()).abs().max().item()
                scale = theirs[:, position].float().abs().max().item()
                rows.append(diff / max(scale, 1e-6))
                if diff > 0.02 * scale + 1e-3:
                    failures.append(f"position {position}: layer {index} {name} row differs by {diff:.4g} "
                                    f"(row's largest {scale:.4g})")
                if position + 1 < ours.shape[1] and not torch.equal(ours[:, position + 1], theirs[:, position + 1]):
                    failures.append(f"position {position}: layer {index} {name} row {position + 1} changed")
        print(f"check at {position}: logits cosine {cosine:.6f}, largest difference {worst:.4g} "
              f"(largest logit {expected.abs().max().item():.4g}), top-1 {'same' if top1 else 'differs'}; "
              f"K/V rows' largest relative difference {max(rows):.3g}", file=sys.stderr, flush=True)
        best, second = expected.topk(2).values.tolist()
        if cosine < 0.999 or (not top1 and best - second > 2 * worst):
            failures.append(f"position {position}: logits cosine {cosine:.6f}, top-1 same {top1}")
    capacity = keys[0].shape[1]
    before_k, before_v = keys[0][:, capacity - 1].clone(), values[0][:, capacity - 1].clone()
    step.logits.fill_(7.0)
    step.position.fill_(capacity)
    step.launch()
    torch.cuda.synchronize()
    if step.error_word() != BAD_POSITION:
        failures.append(f"position {capacity} (the capacity): error word {step.error_word()}, not {BAD_POSITION}")
    if not (step.logits == 7.0).all() or not torch.equal(keys[0][:, capacity - 1], before_k) or not torch.equal(
            values[0][:, capacity - 1], before_v):
        failures.append(f"position {capacity} (the capacity): the step wrote logits or cache rows")
    step.workspace.zero_()
    return failures


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
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lib = build_library(args.out)
    model = bench_model.build("llama-3.2-1b", device="cuda")
    config = model.config
    cache = peers.static_cache(model, args.max_cache)
    torch.manual_seed(1)
    for layer in cache.layers:  # history the step attends over: random, the same in both caches
        layer.keys.normal_()
        layer.values.normal_()
    keys = [layer.keys[0].clone() for layer in cache.layers]
    values = [layer.values[0].clone() for layer in cache.layers]
    step = MegakernelStep(lib, model, keys, values)
    failures = check(model, step, cache, keys, values, CHECK_POSITIONS)
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
