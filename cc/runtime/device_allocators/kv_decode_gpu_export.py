"""Exports the programs of kv_decode_gpu.cc, on the GPU machine (torch with CUDA, the
executorch wheel; no ExecuTorch Python runtime needed), and measures eager PyTorch there.

    kv_decode_gpu_export.py DIR --device=cuda [--contexts 256,1024,4096,8192]

DIR/check/: the example's program (examples/kv_program.py: prefill + decode sharing runtime-owned
  zero-copy caches, initial capacity 16, so decoding grows them) as kv_decode.pte, and with its
  engines' runs captured as CUDA graphs (cuda_graph) as kv_decode_graph.pte; tokens.bin (int64: the prompt, then
  the token fed to each decode step: eager's greedy choice), reference.bin (float32: eager's logits
  for every prompt position, then for each decode step) and shape.txt (prompt steps vocab layers).
DIR/bench/CTX/ (with --contexts): the bench decoder's decode step with caller-owned caches of CTX
  positions, zero_copy.pte and staged.pte (zero_copy_kv=False), engine.blob (the zero-copy
  program's delegate blob: the bare engine), and DIR/bench/eager.tsv: eager PyTorch's per-step
  latency with the same static caches (median, ms), inputs from and logits to the host.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys
import time

import torch

from examples.kv_program import export_program
from examples.llama_decoder import Config, LlamaDecoder

CHECK_CONFIG = Config()
CHECK_PROMPT, CHECK_STEPS, CHECK_MAX_CAPACITY, CHECK_INITIAL_CAPACITY = 16, 48, 256, 16
# A decoder whose caches dominate a step at long contexts: 4 layers, 16 heads x 64, float32.
BENCH_CONFIG = Config(vocab=4096, hidden=1024, layers=4, heads=16, head_dim=64, ffn=2816)
EAGER_STEPS = 50


def _compile_with_the_example_inputs():
    """AOTInductor's compile-time autotuning for CUDA runs the kernels on generated inputs, and
    random cache positions index past a dynamic capacity (a device-side assert, seen on the H200 with
    torch 2.11); without it, the kernels are tuned on the example inputs, which are valid."""
    import torch._inductor.config

    torch._inductor.config.triton.autotune_at_compile_time = False


def _reported(export):
    """Runs `export` in a pool worker, returning a line that says what it did or why it failed (an
    exception may not survive the trip back to the parent)."""

    def run(*args):
        try:
            _compile_with_the_example_inputs()
            return "exported " + export(*args)
        except Exception as error:  # noqa: BLE001  (reported to the parent, which fails)
            return f"FAILED {export.__name__}{args}: {type(error).__name__}: {error}"

    return run


def export_check(directory, device):
    import zerokv.executorch as zx

    os.makedirs(directory, exist_ok=True)
    for program, cuda_graph in (("kv_decode", False), ("kv_decode_graph", True)):
        manager = export_program(CHECK_CONFIG, seed=0, device=device, max_capacity=CHECK_MAX_CAPACITY,
                                 initial_capacity=CHECK_INITIAL_CAPACITY, prefill_length=CHECK_PROMPT,
                                 cuda_graph=cuda_graph)
        zx.save(manager, os.path.join(directory, program + ".pte"))
    eager = LlamaDecoder(CHECK_CONFIG, max_seq=CHECK_MAX_CAPACITY).eval()
    prompt = torch.randint(0, CHECK_CONFIG.vocab, (1, CHECK_PROMPT), generator=torch.Generator().manual_seed(0))
    tokens, logits = [prompt.flatten()], []
    with torch.no_grad():
        step = eager(prompt, torch.tensor(0))
        logits.append(step.flatten())
        for position in range(CHECK_PROMPT, CHECK_PROMPT + CHECK_STEPS):
            token = step[:, -1:].argmax(-1)
            tokens.append(token.flatten())
            step = eager(token, torch.tensor(position))
            logits.append(step.flatten())
    torch.cat(tokens).numpy().tofile(os.path.join(directory, "tokens.bin"))
    torch.cat(logits).numpy().tofile(os.path.join(directory, "reference.bin"))
    with open(os.path.join(directory, "shape.txt"), "w") as shape:
        shape.write(f"{CHECK_PROMPT} {CHECK_STEPS} {CHECK_CONFIG.vocab} {CHECK_CONFIG.layers}\n")
    return "check"


def export_bench(directory, context, zero_copy, device):
    import zerokv.executorch as zx
    from zerokv.executorch.delegates import sole_delegate_blob

    model = LlamaDecoder(BENCH_CONFIG, max_seq=context).eval()
    with torch.no_grad():
        program = torch.export.export(model, (torch.zeros(1, 1, dtype=torch.long), torch.tensor(0)))
    manager = zx.export(program, engine="aoti", zero_copy_kv=zero_copy, engine_options={"compile_device": device})
    os.makedirs(directory, exist_ok=True)
    zx.save(manager, os.path.join(directory, "zero_copy.pte" if zero_copy else "staged.pte"))
    if zero_copy:
        with open(os.path.join(directory, "engine.blob"), "wb") as out:
            out.write(sole_delegate_blob(manager.exported_program("forward").graph_module))
    return f"{context} {'zero-copy' if zero_copy else 'staged'}"


def eager_step_ms(context):
    """Median per decode step of eager PyTorch on the GPU, the token and position from the host and
    the logits back to it, as the ExecuTorch runs have them."""
    model = LlamaDecoder(BENCH_CONFIG, max_seq=context).eval().cuda()
    times = []
    with torch.no_grad():
        for step in range(EAGER_STEPS + 5):
            token, position = torch.tensor([[step % BENCH_CONFIG.vocab]]), torch.tensor(context // 2 + step)
            torch.cuda.synchronize()
            started = time.perf_counter()
            model(token.cuda(), position.cuda()).cpu()
            times.append(time.perf_counter() - started)
    return statistics.median(times[5:]) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--contexts", default="", help="comma-separated context lengths to bench")
    parser.add_argument("--jobs", type=int, default=4, help="exports compiled in parallel")
    args = parser.parse_args()
    contexts = [int(context) for context in args.contexts.split(",") if context]
    bench = os.path.join(args.out, "bench")
    failed = False
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = [pool.submit(_export_check, os.path.join(args.out, "check"), args.device)]
        jobs += [pool.submit(_export_bench, os.path.join(bench, str(context)), context, zero_copy, args.device)
                 for context in contexts for zero_copy in (True, False)]
        for job in concurrent.futures.as_completed(jobs):
            print(job.result(), flush=True)
            failed |= job.result().startswith("FAILED")
    if contexts and args.device == "cuda":
        with open(os.path.join(bench, "eager.tsv"), "w") as out:
            for context in contexts:
                out.write(f"{context}\t{eager_step_ms(context):.4f}\n")
    return 1 if failed else 0


def _export_check(*args):
    return _reported(export_check)(*args)


def _export_bench(*args):
    return _reported(export_bench)(*args)


if __name__ == "__main__":
    sys.exit(main())
