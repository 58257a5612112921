"""kv_decode: a small Llama-style decoder exported with zero-copy, runtime-owned KV caches, run
through the ExecuTorch runtime with zerokv's backend: a prefill, then N decode steps, against eager.

    bazel run //examples:kv_decode                       # on the CPU
    bazel run //examples:kv_decode -- --device=cuda      # on a CUDA GPU (needs the CUDA toolkit)
    bazel run //examples:kv_decode -- --steps=256 --max_capacity=4096

Prints decode tokens per second, per-step latency, the bytes copied between host and device per step
(ExecuTorch's copies of the method's inputs and outputs, counted by zerokv's device allocator; the
runtime-owned caches are never among them) and the caches' growth, and the agreement with eager
PyTorch (top-1 match rate and minimum cosine similarity of the logits, the same tokens fed to both).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import statistics
import sys
import time

from absl import app, flags

from examples.backend_library import KVMetrics as _KVMetrics
from examples.backend_library import load_backend

FLAGS = flags.FLAGS
flags.DEFINE_enum("device", "cpu", ["cpu", "cuda"], "Where the engines compile and run.")
flags.DEFINE_enum("model", "small", ["tiny", "small"], "Decoder size (tiny: the tests').")
flags.DEFINE_integer("prompt_length", 16, "Prompt tokens (random, from the seed) run by prefill.")
flags.DEFINE_integer("steps", 64, "Decode steps after the prefill.")
flags.DEFINE_integer("max_capacity", 1024, "Most positions a cache may hold.")
flags.DEFINE_integer("initial_capacity", 32, "Positions the caches start with (they double on demand).")
flags.DEFINE_integer("seed", 0, "Seed of the weights and of the prompt.")
flags.DEFINE_string("program", None, "Run this .pte (written by --export_only) instead of exporting.")
flags.DEFINE_string("export_only", None, "Export to this .pte and exit.")
flags.DEFINE_string("host_backend_library", None, "libzerokv_backend_host_device.so (--device=cpu).")
flags.DEFINE_string("cuda_backend_library", None, "libzerokv_backend_cuda.so (--device=cuda).")


@dataclasses.dataclass
class Report:
    prompt_length: int
    steps: int
    step_seconds: list
    copied_bytes_per_step: list  # host<->device, per decode step
    growths: int
    growth_bytes_moved: int
    capacity: int
    length: int
    top1_match_rate: float
    min_cosine: float
    cache_bytes: int  # every layer's K and V storage held at the end (reserves and retired storage too)

    @property
    def tokens_per_second(self):
        return len(self.step_seconds) / sum(self.step_seconds)


def run_decode(library, program_path: str, config, *, seed: int, prompt_length: int, steps: int,
               max_capacity: int) -> Report:
    import torch

    import zerokv.executorch as zx
    from examples.llama_decoder import LlamaDecoder

    program = zx.load_program(program_path)  # with its weights, in the .ptd beside it
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    eager = LlamaDecoder(config, max_seq=max_capacity, seed=seed).eval()
    prompt = torch.randint(0, config.vocab, (1, prompt_length), generator=torch.Generator().manual_seed(seed))

    def copied():
        return library.zerokv_host_to_device_bytes() + library.zerokv_device_to_host_bytes()

    matches, cosines = [], []

    def compare(logits, tokens, position):
        with torch.no_grad():
            reference = eager(tokens, torch.tensor(position))
        matches.extend((logits.argmax(-1) == reference.argmax(-1)).flatten().tolist())
        cosines.extend(torch.nn.functional.cosine_similarity(logits, reference, dim=-1).flatten().tolist())

    (logits,) = prefill.execute([prompt, torch.tensor(0)])
    compare(logits, prompt, 0)
    token = logits[:, -1:].argmax(-1)
    step_seconds, copied_per_step = [], []
    for position in range(prompt_length, prompt_length + steps):
        before = copied()
        started = time.perf_counter()
        (logits,) = decode.execute([token, torch.tensor(position)])
        step_seconds.append(time.perf_counter() - started)
        copied_per_step.append(copied() - before)
        compare(logits, token, position)
        token = logits.argmax(-1)
    metrics = _KVMetrics()
    # One cache (K and V) per layer, in the implicit sequence: the program was loaded without one.
    sequence = library.zerokv_kv_implicit_sequence()
    caches = library.zerokv_kv_sequence_metrics(sequence, ctypes.byref(metrics))
    library.zerokv_kv_sequence_release(sequence)
    if caches != config.layers:
        raise RuntimeError(f"{program_path}: expected {config.layers} runtime-owned caches (one per layer)")
    return Report(
        prompt_length=prompt_length, steps=steps, step_seconds=step_seconds, copied_bytes_per_step=copied_per_step,
        growths=metrics.growths, growth_bytes_moved=metrics.bytes_moved,
        capacity=metrics.capacity // config.layers, length=metrics.length // config.layers,
        top1_match_rate=sum(matches) / len(matches), min_cosine=min(cosines),
        cache_bytes=metrics.bytes_reserved)


def print_report(report: Report, config, device: str):
    milliseconds = sorted(seconds * 1e3 for seconds in report.step_seconds)
    p90 = milliseconds[int(0.9 * (len(milliseconds) - 1))]
    print(f"model: {config.layers} layers, hidden {config.hidden}, {config.heads} heads x {config.head_dim}, "
          f"vocab {config.vocab}; device {device}")
    print(f"prefill: {report.prompt_length} tokens; decode: {report.steps} steps")
    print(f"decode: {report.tokens_per_second:.1f} tokens/s; per step median {statistics.median(milliseconds):.3f} ms,"
          f" p90 {p90:.3f} ms, min {milliseconds[0]:.3f} ms")
    print(f"bytes copied host<->device per decode step: max {max(report.copied_bytes_per_step)} "
          f"(token + position in, logits out); KV cache bytes copied per step: 0 "
          f"(caches: {report.cache_bytes} bytes, runtime-owned, written in place)")
    print(f"caches: {report.length} positions committed, capacity {report.capacity}; "
          f"{report.growths} growths moved {report.growth_bytes_moved} bytes in all")
    print(f"agreement with eager: top-1 match {report.top1_match_rate:.4f}, "
          f"min cosine similarity {report.min_cosine:.6f}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from examples.llama_decoder import TINY, Config

    config = TINY if FLAGS.model == "tiny" else Config()
    if FLAGS.export_only is None:
        if FLAGS.prompt_length + FLAGS.steps > FLAGS.max_capacity:
            raise app.UsageError(f"--prompt_length + --steps ({FLAGS.prompt_length + FLAGS.steps}) exceeds "
                                 f"--max_capacity ({FLAGS.max_capacity})")
        # The backend registers before the Python runtime is imported (by run_decode).
        library = load_backend(FLAGS.cuda_backend_library if FLAGS.device == "cuda" else FLAGS.host_backend_library)
    program_path = FLAGS.program
    if program_path is None:
        from examples.kv_program import export_program

        import zerokv.executorch as zx

        manager = export_program(config, seed=FLAGS.seed, device=FLAGS.device, max_capacity=FLAGS.max_capacity,
                                 initial_capacity=FLAGS.initial_capacity, prefill_length=FLAGS.prompt_length)
        program_path = FLAGS.export_only or os.path.join(os.environ.get("TMPDIR", "/tmp"), "kv_decode.pte")
        zx.save(manager, program_path)
        print(f"wrote {program_path}", file=sys.stderr)
        if FLAGS.export_only:
            return
    report = run_decode(library, program_path, config, seed=FLAGS.seed, prompt_length=FLAGS.prompt_length,
                        steps=FLAGS.steps, max_capacity=FLAGS.max_capacity)
    print_report(report, config, FLAGS.device)


if __name__ == "__main__":
    app.run(main)
