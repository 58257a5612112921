"""Writes the runtime-owned KV programs of the end-to-end test (a build step, so the compile is cached).

    make_program.py OUT.pte MIXED.pte
    make_program.py --ring OUT.pte

zerokv.executorch.runtime_kv_models (fixed seed) with two methods: "prefill" (PREFILL tokens; it
writes the caches without reading them, as a Hugging Face prefill does) and "decode" (1 token), compiled by AOTInductor for the CPU and delegated to cuda:0
(run over a host-memory device allocator). Its K and V caches are runtime-owned: flat, initial
capacity INITIAL_CAPACITY, growing up to MAX_CAPACITY, shared by both methods; the step width is
dim 1 of "tokens", and the runtime fills "position" with each step's first position.

OUT.pte's weights go to OUT.ptd beside it (the default); MIXED.pte and the ring program keep theirs
in the .pte (named_data="pte").

MIXED.pte: the decode step of runtime_kv_models.MixedCacheDecoder, whose one delegate writes the
runtime-owned caches (as above, up to MIXED_MAX_CAPACITY) and two caller-owned buffer caches in place.

--ring: RingDecoder, one "decode" method (1 token) over a ring cache of WINDOW positions whose
writes are indexed by "slots", which the runtime fills with the position modulo WINDOW.
"""

import sys

import torch
import torch.nn.functional as F

import zerokv.executorch as zx
from zerokv.executorch import runtime_kv_models as models

PREFILL = 3
INITIAL_CAPACITY = 4
MAX_CAPACITY = 64
MIXED_MAX_CAPACITY = models.MixedCacheDecoder.BUFFER_CAPACITY
WINDOW = 8


class RingDecoder(models.CacheInputDecoder):
    """CacheInputDecoder's one-token step over a ring cache: the token's K and V go to `slots` (the
    runtime's: position mod WINDOW), and it attends over every slot written so far."""

    def forward(self, tokens, position, slots, k_cache, v_cache):
        x = self.embed[tokens]
        q, k, v = (x @ self.qkv).view(1, 1, 3, models.HEADS, models.HEAD_DIM).permute(2, 0, 3, 1, 4)
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        mask = torch.arange(k_cache.shape[2])[None, :] <= position
        attention = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        return attention.transpose(1, 2).reshape(1, 1, models.HEADS * models.HEAD_DIM) @ self.lm_head


def export_ring_step(model):
    capacity = torch.export.Dim("capacity", min=2, max=WINDOW)
    k_cache, v_cache = models.empty_caches(WINDOW)
    with torch.no_grad():
        return torch.export.export(
            model.eval(),
            (torch.zeros(1, 1, dtype=torch.long), torch.tensor(0), torch.tensor([0]), k_cache, v_cache),
            dynamic_shapes=(None, None, None, {2: capacity}, {2: capacity}),
        )


def ring_runtime_kv():
    layer = zx.KVCacheLayer(k_input="k_cache", v_input="v_cache", max_capacity=WINDOW, initial_capacity=WINDOW,
                            policy="ring", window=WINDOW, slots="slots")
    return zx.RuntimeKV(layers=(layer,), step_width=("tokens", 1), positions="position")


def runtime_kv(max_capacity=MAX_CAPACITY):
    layer = zx.KVCacheLayer(k_input="k_cache", v_input="v_cache", max_capacity=max_capacity,
                            initial_capacity=INITIAL_CAPACITY)
    return zx.RuntimeKV(layers=(layer,), step_width=("tokens", 1), positions="position")


def main():
    if sys.argv[1:2] == ["--ring"]:
        program = zx.export({"decode": export_ring_step(RingDecoder(seed=0))}, engine="aoti",
                            engine_options={"compile_device": "cpu"}, runtime_kv=ring_runtime_kv(),
                            named_data="pte")
        zx.save(program, sys.argv[2])
        return
    out, mixed_out = sys.argv[1:]
    programs = {
        "prefill": models.export_step(models.FreshPrefill(seed=0), PREFILL, MAX_CAPACITY),
        "decode": models.export_step(models.CacheInputDecoder(seed=0), 1, MAX_CAPACITY),
    }
    program = zx.export(programs, engine="aoti", engine_options={"compile_device": "cpu"},
                        runtime_kv=runtime_kv())
    zx.save(program, out)
    mixed = models.export_step(models.MixedCacheDecoder(seed=0), 1, MIXED_MAX_CAPACITY)
    program = zx.export({"decode": mixed}, engine="aoti", engine_options={"compile_device": "cpu"},
                        runtime_kv=runtime_kv(MIXED_MAX_CAPACITY), named_data="pte")
    zx.save(program, mixed_out)


if __name__ == "__main__":
    main()
