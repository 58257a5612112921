"""Writes the runtime-owned KV check's inputs (gpu_runtime_kv_check.cc), on the GPU machine:

    make_runtime_kv_blob.py OUT_DIR [--device cuda|cpu]

OUT_DIR/runtime_kv.blob  an AOTInductor attention step whose BF16 K and V caches are runtime-owned
                         (KV manifest: flat, initial capacity INITIAL_CAPACITY, max MAX_CAPACITY,
                         storage key STORAGE_KEY; step width: dim 2 of x, argument input 0;
                         the runtime fills `position` with each step's first position)
OUT_DIR/x.bin            every step's x, BF16, [1, HEADS, steps, HEAD_DIM], concatenated: a prefill
                         of PREFILL tokens, then DECODE single-token steps
OUT_DIR/expected.bin     every step's output from eager torch over full-size caches, same layout

The step writes x at positions [position, position + steps) of K (and 2x of V) and attends over
every cached position up to its own, so a lost or misplaced earlier write changes the output.
"""

import argparse
import os

import torch

from zerokv import blob
from zerokv.aoti import compile_aoti

HEADS, HEAD_DIM = 2, 16
PREFILL, DECODE = 3, 40
INITIAL_CAPACITY, MAX_CAPACITY = 4, 64
STORAGE_KEY = "gpu_check/layers.0"


class AttentionStep(torch.nn.Module):
    def forward(self, x, position, k_cache, v_cache):
        positions = torch.arange(x.shape[2], device=x.device) + position
        k_cache.index_copy_(2, positions, x)
        v_cache.index_copy_(2, positions, x * 2)
        mask = torch.arange(k_cache.shape[2], device=x.device)[None, :] <= positions[:, None]
        # Attention spelled out rather than scaled_dot_product_attention: AOTInductor would pick
        # cuDNN's flash kernel, whose wgmma pipeline compute-sanitizer's racecheck cannot follow.
        scores = (x @ k_cache.transpose(-1, -2)) / HEAD_DIM**0.5
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return weights @ v_cache


def steps(device):
    generator = torch.Generator().manual_seed(0)
    widths = [PREFILL] + [1] * DECODE
    return [torch.randn(1, HEADS, width, HEAD_DIM, generator=generator).to(device, torch.bfloat16) for width in widths]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = args.device
    cache = lambda capacity: torch.zeros(1, HEADS, capacity, HEAD_DIM, dtype=torch.bfloat16, device=device)
    example = (torch.zeros(1, HEADS, 2, HEAD_DIM, dtype=torch.bfloat16), torch.tensor([0]), cache(8), cache(8))
    width = torch.export.Dim("steps", min=1, max=8)
    capacity = torch.export.Dim("capacity", min=2, max=MAX_CAPACITY)
    build = compile_aoti(AttentionStep(), example, device, binding_device=blob.Device.CUDA,
                         dynamic_shapes=({2: width}, None, {2: capacity}, {2: capacity}))
    names = [binding.name for binding in build.bindings]
    assert names[:4] == ["x", "position", "k_cache", "v_cache"], names
    layer = blob.KVLayer("k_cache", "v_cache", STORAGE_KEY, blob.DType.BFLOAT16, HEADS, HEAD_DIM,
                         blob.KVPolicy.FLAT, 0, INITIAL_CAPACITY, MAX_CAPACITY, "")
    data = blob.serialize(blob.Blob(
        engine_kind=blob.EngineKind.AOTI,
        device_id=0,
        aliased_outputs_elided=False,
        metadata=blob.Metadata(bindings=build.bindings, aliased_io=build.aliased_io, kv_layers=[layer],
                               step_width_source="0:2", positions_binding="position"),
        payload=build.payload,
    ))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "runtime_kv.blob"), "wb") as out:
        out.write(data)

    xs = steps(device)
    model = AttentionStep()
    k_cache, v_cache = cache(MAX_CAPACITY), cache(MAX_CAPACITY)
    expected, position = [], 0
    with torch.no_grad():
        for x in xs:
            expected.append(model(x, torch.tensor([position], device=device), k_cache, v_cache))
            position += x.shape[2]
    for name, tensors in (("x.bin", xs), ("expected.bin", expected)):
        raw = torch.cat([t.reshape(-1) for t in tensors]).cpu().view(torch.int16).numpy().tobytes()
        with open(os.path.join(args.out_dir, name), "wb") as out:
            out.write(raw)
    print("bindings:", [(b.name, b.direction.name, b.dtype.name, [(d.min, d.max) for d in b.shape]) for b in build.bindings])
    print("aliased_io:", build.aliased_io)


if __name__ == "__main__":
    main()
