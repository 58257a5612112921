"""Writes the runtime-owned KV program of the end-to-end test (a build step, so the compile is cached).

    make_program.py OUT.pte MIXED.pte

zerokv.executorch.runtime_kv_models (fixed seed) with two methods: "prefill" (PREFILL tokens; it
writes the caches without reading them, as a Hugging Face prefill does) and "decode" (1 token), compiled by AOTInductor for the CPU and delegated to cuda:0
(run over a host-memory device allocator). Its K and V caches are runtime-owned: flat, initial
capacity INITIAL_CAPACITY, growing up to MAX_CAPACITY, shared by both methods; the step width is
dim 1 of "tokens".

MIXED.pte: the decode step of runtime_kv_models.MixedCacheDecoder, whose one delegate writes the
runtime-owned caches (as above, up to MIXED_MAX_CAPACITY) and two caller-owned buffer caches in place.
"""

import sys

import zerokv.executorch as zx
from zerokv.executorch import runtime_kv_models as models

PREFILL = 3
INITIAL_CAPACITY = 4
MAX_CAPACITY = 64
MIXED_MAX_CAPACITY = models.MixedCacheDecoder.BUFFER_CAPACITY


def runtime_kv(max_capacity=MAX_CAPACITY):
    layer = zx.KVCacheLayer(k_input="k_cache", v_input="v_cache", max_capacity=max_capacity,
                            initial_capacity=INITIAL_CAPACITY)
    return zx.RuntimeKV(layers=(layer,), step_width=("tokens", 1))


def main():
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
                        runtime_kv=runtime_kv(MIXED_MAX_CAPACITY))
    zx.save(program, mixed_out)


if __name__ == "__main__":
    main()
