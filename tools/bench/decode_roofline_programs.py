"""The zerokv programs //tools/bench:decode_roofline runs, and eager's reference, exported on the
GPU machine (torch with CUDA and Triton, transformers, the executorch wheel):

    decode_roofline_programs.py DIR [--shape llama-3.2-1b] [--max-cache 32768] [--initial-capacity 256]
                                    [--linear matvec|torch] [--programs runtime_owned static staged reference]

Each is one decode step of the model (tools/bench/decode_roofline_model.py) compiled by AOTInductor
for CUDA, its full-attention layers on zerokv's split-K decode kernels (hf_decode_attention), its linear layers
on zerokv's matrix-vector kernel (hf_decode_linear), Inductor's own kernels tuned by coordinate
descent (engine option coordinate_descent_tuning), its runs captured as CUDA graphs (engine option
cuda_graph):
  DIR/runtime_owned/decode.pte (+ .ptd): over runtime-owned caches, grown by doubling from
    --initial-capacity to --max-cache; one engine for every capacity, attention over the committed
    positions only.
  DIR/megakernel/decode.pte (+ .ptd): the step as one persistent CUDA kernel (the MEGAKERNEL engine,
    zerokv.megakernel) over runtime-owned caches grown as runtime_owned's; attention over the
    committed positions only.
  DIR/static/zero_copy.pte (+ .ptd): over caller-owned static caches of --max-cache positions (the
    program's buffers, written in place); attention stops at the committed length.
  DIR/static/staged.pte (+ .ptd): the same with zero_copy_kv=False: the caches are copied in and out
    around the engine at every step.
  DIR/static/engine.blob: the zero-copy program's delegate blob (the bare engine; its weights are in
    zero_copy.ptd).
  DIR/reference/tokens.bin (int64: the token fed at positions 0, 1, ...) and logits.bin (float32
    [steps, vocab]: Hugging Face eager's logits there, SDPA over a dynamic cache).
  DIR/model.json: the shape, weight bytes and KV bytes per position (the roofline's inputs).
--programs exports some of them (model.json is always written): "static reference" is what
decode_roofline needs to time the static step and the bare engine alone (tools/gpu/step_ab.sh).
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys

import torch

from tools.bench import decode_roofline_model as bench_model

REFERENCE_STEPS = 32
PROGRAMS = ("runtime_owned", "megakernel", "static", "staged", "reference")
PROMPT_TOKEN = 1


class StaticCacheStep(torch.nn.Module):
    """forward(input_ids [1, 1], cache_position [1]) -> logits, over static caches the program owns
    (buffers the step writes in place at cache_position)."""

    def __init__(self, model, capacity: int):
        from zerokv.executorch import hf_decoders as hf

        super().__init__()
        self.step = hf.CacheInputs(model)
        self.names = [f"cache_{index}" for index in range(2 * model.config.num_hidden_layers)]
        for name in self.names:
            self.register_buffer(name, torch.zeros(hf.cache_shape(model.config, capacity), dtype=model.dtype))

    def forward(self, input_ids, cache_position):
        return self.step(input_ids, cache_position, *(getattr(self, name) for name in self.names))


def use_decode_kernels(model, linear="matvec"):
    """zerokv's decode kernels in `model`: split-K decode attention and, with linear="matvec",
    one-token linear layers ("torch": Inductor's own lowering of them)."""
    from zerokv.executorch.hf_decode_attention import use_splitk_decode
    from zerokv.executorch.hf_decode_linear import use_matvec_decode

    use_splitk_decode(model)
    if linear == "matvec":
        use_matvec_decode(model)


def _model(shape, linear):
    model = bench_model.build(shape, device="cuda").cpu()  # exported on the CPU, compiled for CUDA
    use_decode_kernels(model, linear)
    return model


def _engine_options():
    import torch._inductor.config

    # AOTInductor autotunes the kernels on the example inputs (valid positions), not on generated
    # ones that index past a dynamic capacity.
    torch._inductor.config.triton.autotune_at_compile_time = False
    return {"compile_device": "cuda", "cuda_graph": True, "coordinate_descent_tuning": True}


def export_runtime_owned(directory, shape, linear, max_cache, initial_capacity):
    import zerokv.executorch as zx
    from zerokv.executorch import hf_decoders as hf

    model = _model(shape, linear)
    programs, runtime_kv = hf.export_programs(model, max_cache, 1, initial_capacity, prefill=False)
    manager = zx.export(programs, engine="aoti", engine_options=_engine_options(), runtime_kv=runtime_kv)
    os.makedirs(directory, exist_ok=True)
    zx.save(manager, os.path.join(directory, "decode.pte"))
    return "runtime-owned"


def export_megakernel(directory, shape, max_cache, initial_capacity):
    import zerokv.executorch as zx
    from zerokv.megakernel.export import export_decode

    model = bench_model.build(shape, device="cuda").cpu()
    program, runtime_kv = export_decode(model, max_cache, initial_capacity)
    manager = zx.export({"decode": program}, engine="megakernel", runtime_kv=runtime_kv)
    os.makedirs(directory, exist_ok=True)
    zx.save(manager, os.path.join(directory, "decode.pte"))
    return "megakernel"


def export_static(directory, shape, linear, max_cache, zero_copy):
    import zerokv.executorch as zx
    from zerokv.executorch.delegates import sole_delegate_blob

    model = _model(shape, linear)
    with torch.no_grad():
        program = torch.export.export(StaticCacheStep(model, max_cache).eval(),
                                      (torch.zeros(1, 1, dtype=torch.long), torch.tensor([0])))
    manager = zx.export(program, engine="aoti", zero_copy_kv=zero_copy, engine_options=_engine_options())
    os.makedirs(directory, exist_ok=True)
    zx.save(manager, os.path.join(directory, "zero_copy.pte" if zero_copy else "staged.pte"))
    if zero_copy:
        with open(os.path.join(directory, "engine.blob"), "wb") as out:
            out.write(sole_delegate_blob(manager.exported_program("forward").graph_module))
    return "static zero-copy" if zero_copy else "static staged"


def write_reference(directory, shape):
    from zerokv.executorch import hf_decoders as hf

    model = bench_model.build(shape, device="cuda")
    logits, tokens = hf.eager_steps(model, torch.tensor([[PROMPT_TOKEN]], device="cuda"), REFERENCE_STEPS)
    os.makedirs(directory, exist_ok=True)
    torch.tensor([PROMPT_TOKEN, *tokens[:-1]]).numpy().tofile(os.path.join(directory, "tokens.bin"))
    torch.cat(logits).float().cpu().numpy().tofile(os.path.join(directory, "logits.bin"))
    return "reference"


def _reported(job, *args):
    """`job` in a pool worker: a line saying what it did or why it failed (an exception may not
    survive the trip back to the parent)."""
    try:
        return "exported " + job(*args)
    except Exception as error:  # noqa: BLE001  (reported to the parent, which fails)
        return f"FAILED {job.__name__}: {type(error).__name__}: {error}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(bench_model.SHAPES))
    parser.add_argument("--max-cache", type=int, default=32768)
    parser.add_argument("--initial-capacity", type=int, default=256)
    parser.add_argument("--linear", default="matvec", choices=["matvec", "torch"],
                        help="the linear layers on zerokv::matvec, or left to Inductor (to measure the kernel)")
    parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS,
                        help="what to export (the static zero-copy program and its bare engine: static)")
    args = parser.parse_args()
    jobs = {"runtime_owned": (export_runtime_owned, os.path.join(args.out, "runtime_owned"), args.shape, args.linear,
                              args.max_cache, args.initial_capacity),
            "megakernel": (export_megakernel, os.path.join(args.out, "megakernel"), args.shape, args.max_cache,
                           args.initial_capacity),
            "static": (export_static, os.path.join(args.out, "static"), args.shape, args.linear, args.max_cache,
                       True),
            "staged": (export_static, os.path.join(args.out, "static"), args.shape, args.linear, args.max_cache,
                       False),
            "reference": (write_reference, os.path.join(args.out, "reference"), args.shape)}
    jobs = [jobs[program] for program in dict.fromkeys(args.programs)]
    failed = False
    with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in concurrent.futures.as_completed([pool.submit(_reported, *job) for job in jobs]):
            print(done.result(), file=sys.stderr, flush=True)
            failed |= done.result().startswith("FAILED")
    model = bench_model.build(args.shape, device="meta")
    with open(os.path.join(args.out, "model.json"), "w") as out:
        json.dump({"shape": args.shape, "max_cache": args.max_cache, "vocab": model.config.vocab_size,
                   "layers": model.config.num_hidden_layers, "reference_steps": REFERENCE_STEPS,
                   "weight_bytes": bench_model.weight_bytes(model),
                   "kv_bytes_per_position": bench_model.kv_bytes_per_position(model)}, out, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
