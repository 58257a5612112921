"""hf_decode: a Hugging Face decoder (a local checkpoint, or a small random config) exported with
runtime-owned KV caches and run through the ExecuTorch runtime with zerokv's backend: a prefill, then
greedy decode steps, against transformers' eager model. Nothing is downloaded.

    bazel run //examples:hf_decode -- --model=llama                        # small random config
    bazel run //examples:hf_decode -- --model=gemma3 --checkpoint=/path/to/dir   # config.json + safetensors

Global layers' caches are flat (they grow up to --max_capacity); sliding-window layers' (Gemma-3's)
are rings of sliding_window + --max_prefill - 1 slots. Prints decode tokens per second, the bytes
copied between host and device per step (ExecuTorch's copies of the method's inputs and outputs; the
runtime-owned caches are never among them) and the agreement with eager (greedy tokens equal, minimum
cosine similarity of every step's logits). The .pte also carries ExecuTorch's LLM metadata methods
(get_max_seq_len, get_vocab_size, use_kv_cache, ...).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "llama", ["llama", "qwen3", "gemma3"], "Family of the random config (ignored "
                  "with --checkpoint, whose config.json names it).")
flags.DEFINE_string("checkpoint", None, "A local Hugging Face checkpoint directory (config.json + safetensors).")
flags.DEFINE_string("prompt", "5,17,42,9,3,77", "Prompt token ids, comma-separated.")
flags.DEFINE_integer("steps", 32, "Greedy decode steps after the prefill.")
flags.DEFINE_integer("max_capacity", 128, "Most positions a cache may hold.")
flags.DEFINE_integer("initial_capacity", 16, "Positions the caches start with (they double on demand).")
flags.DEFINE_integer("max_prefill", 32, "Most prompt tokens one prefill takes (a sliding layer's ring holds "
                     "its window + max_prefill - 1 positions).")
flags.DEFINE_integer("seed", 0, "Seed of the random config's weights.")
flags.DEFINE_string("program", None, "Run this .pte (written by --export_only) instead of exporting.")
flags.DEFINE_string("export_only", None, "Export to this .pte and exit.")
flags.DEFINE_string("host_backend_library", None, "libzerokv_backend_host_device.so.")


@dataclasses.dataclass
class Report:
    tokens: list  # greedy, the prefill's first
    eager_tokens: list
    cosines: list  # per step, the prefill's last position first
    step_seconds: list
    copied_bytes_per_step: list

    @property
    def tokens_per_second(self):
        return len(self.step_seconds) / sum(self.step_seconds)


def load_model(checkpoint: str | None, family: str, seed: int):
    from zerokv.executorch import hf_decoders as hf

    return hf.load_checkpoint(checkpoint) if checkpoint else hf.tiny(family, seed)


def export_program(model, *, max_capacity: int, initial_capacity: int, max_prefill: int):
    """prefill (dynamic length) and decode over runtime-owned caches, compiled by AOTInductor for
    the CPU (the delegates run over a host-memory device allocator), with the LLM metadata methods."""
    import zerokv.executorch as zx
    from examples.kv_program import _progress
    from zerokv.executorch import hf_decoders as hf

    with _progress(3, "export") as bar:
        bar.set_postfix_str("tracing prefill and decode")
        programs, runtime_kv = hf.export_programs(model, max_capacity, max_prefill, initial_capacity)
        bar.update()
        bar.set_postfix_str("lowering and compiling 2 AOTInductor engines (cpu)")
        started = time.monotonic()
        manager = zx.export(programs, engine="aoti", engine_options={"compile_device": "cpu"},
                            runtime_kv=runtime_kv,
                            constant_methods=hf.constant_methods(model, max_capacity))
        bar.update()
        bar.set_postfix_str(f"compiled in {time.monotonic() - started:.0f} s")
        bar.update()
    return manager


def run_decode(library, program_path: str, model, prompt: list, steps: int) -> Report:
    import torch
    from tqdm import tqdm

    import zerokv.executorch as zx
    from zerokv.executorch import hf_decoders as hf

    program = zx.load_program(program_path)  # with its weights, in the .ptd beside it
    prefill, decode = program.load_method("prefill"), program.load_method("decode")
    prompt = torch.tensor([prompt])
    eager_logits, eager_tokens = hf.eager_steps(model, prompt, steps)

    def copied():
        return library.zerokv_host_to_device_bytes() + library.zerokv_device_to_host_bytes()

    # The runtime supplies the positions (and a ring's slots): the inputs only give the step's width.
    (logits,) = prefill.execute(hf.step_inputs(model.config, prompt))
    logits = logits[:, -1]
    tokens, cosines = [int(logits.argmax(-1))], []
    cosines.append(float(torch.nn.functional.cosine_similarity(logits, eager_logits[0])))
    step_seconds, copied_per_step = [], []
    for step in tqdm(range(1, steps + 1), desc="decode", unit="token", file=sys.stderr):
        before = copied()
        started = time.perf_counter()
        (logits,) = decode.execute(hf.step_inputs(model.config, torch.tensor([[tokens[-1]]])))
        step_seconds.append(time.perf_counter() - started)
        copied_per_step.append(copied() - before)
        logits = logits[:, -1]
        tokens.append(int(logits.argmax(-1)))
        cosines.append(float(torch.nn.functional.cosine_similarity(logits, eager_logits[step])))
    return Report(tokens=tokens, eager_tokens=eager_tokens, cosines=cosines, step_seconds=step_seconds,
                  copied_bytes_per_step=copied_per_step)


def print_report(report: Report, model):
    config = model.config
    print(f"model: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads, vocab {config.vocab_size}")
    print(f"decode: {len(report.step_seconds)} steps, {report.tokens_per_second:.1f} tokens/s")
    print(f"bytes copied host<->device per decode step: max {max(report.copied_bytes_per_step)} "
          "(token, position and any ring slots in, logits out; the KV caches are runtime-owned, written in place)")
    agree = sum(a == b for a, b in zip(report.tokens, report.eager_tokens))
    print(f"agreement with eager: greedy tokens {agree}/{len(report.tokens)} equal, "
          f"min cosine similarity of the logits {min(report.cosines):.6f}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    prompt = [int(token) for token in FLAGS.prompt.split(",")]
    if len(prompt) < 2 or len(prompt) > FLAGS.max_prefill:
        raise app.UsageError(f"--prompt: {len(prompt)} tokens, the prefill takes 2 to {FLAGS.max_prefill}")
    if len(prompt) + FLAGS.steps > FLAGS.max_capacity:
        raise app.UsageError(f"prompt + --steps ({len(prompt) + FLAGS.steps}) exceeds --max_capacity "
                             f"({FLAGS.max_capacity})")
    if FLAGS.export_only is None:
        from examples.backend_library import load_backend

        # The backend registers before the Python runtime is imported (by run_decode).
        library = load_backend(FLAGS.host_backend_library)
    model = load_model(FLAGS.checkpoint, FLAGS.model, FLAGS.seed)
    program_path = FLAGS.program
    if program_path is None:
        import zerokv.executorch as zx

        manager = export_program(model, max_capacity=FLAGS.max_capacity, initial_capacity=FLAGS.initial_capacity,
                                 max_prefill=FLAGS.max_prefill)
        program_path = FLAGS.export_only or os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_decode.pte")
        zx.save(manager, program_path)
        print(f"wrote {program_path}", file=sys.stderr)
        if FLAGS.export_only:
            return
    print_report(run_decode(library, program_path, model, prompt, FLAGS.steps), model)


if __name__ == "__main__":
    app.run(main)
