"""What ExecuTorch named data buys a zerokv program on the CPU: the example's Llama-style decoder
scaled to ~1B parameters (random weights, bfloat16 by default), exported with zerokv.executorch (AOTInductor,
compiled for the CPU, delegated to cuda:0 over the host-memory device allocator), saved, and loaded
in a fresh process.

    bazel run //tools/bench:weights_load [-- --layers=16 --named_data=pte --methods=decode,prefill]

Prints the weights' size, the .pte and .ptd sizes, and for the load in a child process
(zerokv.executorch.load_program, then load_method: every delegate's init), from a cold page cache
(the two files evicted) and then a warm one: the wall time, the peak resident memory (VmHWM) above
the child's baseline, and the resident memory split into file pages (RssFile: the mapped .pte/.ptd)
and anonymous memory (RssAnon: copies), and what is locked (VmLck), after the load and after one
decode step (which reads every weight). A measurement, not a test.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("layers", 16, "decoder layers")
flags.DEFINE_integer("hidden", 2048, "hidden size")
flags.DEFINE_integer("heads", 16, "attention heads")
flags.DEFINE_integer("head_dim", 128, "head size")
flags.DEFINE_integer("ffn", 6144, "MLP width")
flags.DEFINE_integer("vocab", 32000, "vocabulary")
flags.DEFINE_string("methods", "decode", "the methods to export, of decode,prefill")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "the weights' dtype")
flags.DEFINE_enum("named_data", "ptd", ["ptd", "pte"], "where the weights go (zerokv.executorch.export)")
flags.DEFINE_string("backend_library", None, "libzerokv_backend_host_device.so")
flags.DEFINE_string("directory", None, "where to write the program (default: a temporary directory)")
flags.DEFINE_string("child", None, "internal: load this .pte and print the measurements as JSON")
FLAGS = flags.FLAGS

MAX_CAPACITY, PREFILL = 256, 8


def _status():
    """This process's memory (bytes) from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "VmLck"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS


def _child(path):
    import ctypes

    ctypes.CDLL(FLAGS.backend_library, os.RTLD_GLOBAL)  # registers ZeroKVBackend before the runtime loads
    import torch

    import zerokv.executorch as zx

    _reset_peak()
    before = _status()
    started = time.monotonic()
    program = zx.load_program(path)
    methods = {name: program.load_method(name) for name in FLAGS.methods.split(",")}
    load_seconds = time.monotonic() - started
    loaded = _status()
    methods["decode"].execute([torch.zeros(1, 1, dtype=torch.long), torch.tensor(0)])
    stepped = _status()
    print(json.dumps({"load_seconds": load_seconds, "before": before, "loaded": loaded, "stepped": stepped}))


def _export(directory):
    import torch

    import zerokv.executorch as zx
    from examples.kv_program import export_step, runtime_kv
    from examples.llama_decoder import Config, LlamaDecoder

    config = Config(vocab=FLAGS.vocab, hidden=FLAGS.hidden, layers=FLAGS.layers, heads=FLAGS.heads,
                    head_dim=FLAGS.head_dim, ffn=FLAGS.ffn)
    model = LlamaDecoder(config).to(getattr(torch, FLAGS.dtype))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    parameters = sum(p.numel() for p in model.parameters())
    steps = {"decode": 1, "prefill": PREFILL}
    programs = {name: export_step(model, steps[name], MAX_CAPACITY) for name in FLAGS.methods.split(",")}
    started = time.monotonic()
    manager = zx.export(programs, engine="aoti", device="cuda:0", engine_options={"compile_device": "cpu"},
                        runtime_kv=runtime_kv(config, MAX_CAPACITY, 16), named_data=FLAGS.named_data)
    path = os.path.join(directory, "decoder.pte")
    zx.save(manager, path)
    del manager, programs, model
    return path, parameters, weights, time.monotonic() - started


def _evict(paths):
    """Drops the files' pages from the page cache, so that the next load reads them from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load_in_child(path):
    child = subprocess.run(
        [sys.executable, sys.argv[0], f"--child={path}", f"--backend_library={FLAGS.backend_library}",
         f"--methods={FLAGS.methods}"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if child.returncode:
        sys.exit(f"loading {path} failed:\n{child.stderr}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _gib(size):
    return f"{size / 2**30:.2f} GiB"


def _mib(size):
    return f"{size / 2**20:.0f} MiB"


def main(argv):
    del argv
    if FLAGS.child:
        _child(FLAGS.child)
        return
    with tempfile.TemporaryDirectory() as scratch:
        directory = FLAGS.directory or scratch
        path, parameters, weights, export_seconds = _export(directory)
        data = os.path.splitext(path)[0] + ".ptd"
        pte_size = os.path.getsize(path)
        ptd_size = os.path.getsize(data) if os.path.exists(data) else 0
        _evict([p for p in (path, data) if os.path.exists(p)])
        loads = {"cold": _load_in_child(path), "warm": _load_in_child(path)}
    print(f"model: {FLAGS.layers} layers, hidden {FLAGS.hidden}, {FLAGS.heads} heads x {FLAGS.head_dim}, "
          f"ffn {FLAGS.ffn}, vocab {FLAGS.vocab}: {parameters / 1e9:.3f} B parameters, {FLAGS.dtype} weights "
          f"{_gib(weights)}; methods {FLAGS.methods}; named data in the {FLAGS.named_data}")
    print(f"export + save: {export_seconds:.0f} s; .pte {_gib(pte_size)} ({pte_size} bytes), "
          f".ptd {_gib(ptd_size)} ({ptd_size} bytes)")
    for cache, result in loads.items():
        before = result["before"]
        print(f"{cache} page cache: load (load_program + load_method) {result['load_seconds']:.2f} s, "
              f"over the child's baseline of {_mib(before['VmRSS'])}:")
        for name in ("loaded", "stepped"):
            status = result[name]
            print(f"  {'after the load' if name == 'loaded' else 'after one decode step'}: resident "
                  f"+{_mib(status['VmRSS'] - before['VmRSS'])} (file pages +{_mib(status['RssFile'] - before['RssFile'])}, "
                  f"anonymous +{_mib(status['RssAnon'] - before['RssAnon'])}, locked {_mib(status['VmLck'])}); "
                  f"peak +{_mib(status['VmHWM'] - before['VmRSS'])}")


if __name__ == "__main__":
    app.run(main)
