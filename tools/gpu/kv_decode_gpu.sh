#!/usr/bin/env bash
# The kv_decode example on a CUDA GPU without Bazel (the H200 machine: no Bazel, no ExecuTorch
# Python runtime, no network), through ExecuTorch's C++ Module API:
#   1. exports the programs with the machine's torch and the executorch 1.5.1 cp312 wheel in .whl/
#      (tools/gpu/kv_decode_gpu_export.py: the example's prefill + decode program with runtime-owned
#      caches, eager's tokens and logits; with KV_BENCH_CONTEXTS, the bench's decode steps with
#      caller-owned caches, zero-copy and staged, and eager's timings);
#   2. builds zerokv's runtime (cc/blob, cc/engines, cc/engines/aoti with ZEROKV_WITH_CUDA, cc/kvcache,
#      cc/runtime with CUDA DeviceOps, the CUDA DeviceAllocator) and tools/gpu/kv_decode_gpu.cc with
#      g++ against the wheel's ExecuTorch SDK (libexecutorch, the optimized kernels) and libtorch;
#   3. runs the check on the delegate's own stream and under a non-blocking caller stream, the bench,
#      then the check under compute-sanitizer memcheck, racecheck and synccheck.
#
#   tools/gpu/kv_decode_gpu.sh                              check only
#   KV_BENCH_CONTEXTS="256 1024 4096 8192" tools/gpu/kv_decode_gpu.sh   check and bench
#   KV_GPU_BUILD_ONLY=1 tools/gpu/kv_decode_gpu.sh          step 2 only (a machine without a GPU)
# On the device machine: run tool with carry [".whl"]. Logs go to $OUT when set.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${KV_GPU_DIR:-/tmp/zerokv_kv_decode_gpu}
LOGS=${OUT:-$BUILD/logs}
PYTHON=${PYTHON:-python3}
CONTEXTS=${KV_BENCH_CONTEXTS:-}
mkdir -p "$LOGS"
source "$ROOT/tools/gpu/runtime_build.sh"
prepare_build

export_programs() {
  if ! "$PYTHON" -c "import executorch.exir" 2>/dev/null; then
    # The wheel and the packages its exporter needs that the machine lacks (ruamel.yaml), all in .whl/.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$BUILD/site" "$ROOT"/.whl/*.whl
    export PYTHONPATH="$BUILD/site"
  fi
  local contexts=${CONTEXTS// /,}
  PYTHONPATH="$BUILD/py:${PYTHONPATH:-}" "$PYTHON" "$ROOT/tools/gpu/kv_decode_gpu_export.py" "$BUILD/programs" \
    --device cuda --contexts "$contexts" --jobs "${KV_EXPORT_JOBS:-5}" >"$LOGS/export.log" 2>&1
}
if [[ "${KV_GPU_BUILD_ONLY:-0}" != 1 ]]; then
  echo "== export (in the background, logs in export.log)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  export_programs & export_pid=$!
fi

build_objects cc/runtime/device_allocators/copy_counters.cc cc/runtime/device_allocators/cuda_device_allocator.cc \
  tools/gpu/kv_decode_gpu.cc
link_program kv_decode_gpu "$BUILD/obj/tools_gpu_kv_decode_gpu.cc.o" \
  -lexecutorch -lexecutorch_kernels_optimized -lexecutorch_threadpool
[[ "${KV_GPU_BUILD_ONLY:-0}" == 1 ]] && exit 0

status=0
# What failed to export is reported and skipped; the rest still runs.
wait "$export_pid" || { echo "export FAILED (export.log)"; status=1; }
grep -a -o -e 'exported [a-z0-9 -]*' -e 'FAILED .*' "$LOGS/export.log" || tail -n 20 "$LOGS/export.log"
run() {  # run NAME COMMAND...: logs to $LOGS/NAME.log, keeps going on failure
  local name=$1; shift
  echo "== $name"
  if "$@" >"$LOGS/$name.log" 2>&1; then echo "ok"; else echo "FAILED ($?)"; status=1; fi
  tail -n 3 "$LOGS/$name.log"
}
CHECK=("$BUILD/kv_decode_gpu" check "$BUILD/programs/check")
[[ -s "$BUILD/programs/check/shape.txt" ]] || { echo "no check program"; CHECK=(false); }
run check_own_stream "${CHECK[@]}" own-stream
run check_caller_stream "${CHECK[@]}" caller-stream
if [[ -n "$CONTEXTS" ]]; then
  echo "== bench (per decode step, batch 1)"
  exported=()
  for context in $CONTEXTS; do
    ls "$BUILD/programs/bench/$context/"{zero_copy.pte,staged.pte,engine.blob} >/dev/null && exported+=("$context")
  done
  "$BUILD/kv_decode_gpu" bench "$BUILD/programs/bench" "${exported[@]}" 2>&1 | tee "$LOGS/bench.md" || status=1
fi
# 20 decode steps after the 16-token prompt: one growth (16 -> 32 -> 64 positions), fewer kernels.
SANITIZER=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
for tool in memcheck racecheck synccheck; do
  for mode in own-stream caller-stream; do
    run "check_${tool}_${mode}" timeout "${KV_SANITIZER_TIMEOUT:-150}" "$SANITIZER" --tool "$tool" --error-exitcode 9 "${CHECK[@]}" "$mode" 20
  done
done
exit $status
