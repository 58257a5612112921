#!/usr/bin/env bash
# The zerokv runtime's CUDA check, for the GPU machine (no Bazel, no network there):
#   1. compiles a CUDA AOTInductor decode-step blob with the machine's torch
#      (py/zerokv/aoti/make_decode_blob.py --device cuda), and a runtime-owned KV blob with its
#      inputs and eager outputs (tools/gpu/make_runtime_kv_blob.py);
#   2. builds the runtime (cc/blob, cc/engines, cc/engines/aoti with ZEROKV_WITH_CUDA, cc/kvcache,
#      cc/runtime with CUDA DeviceOps) and the checks tools/gpu/gpu_decode_check.cc (caller-owned
#      cache) and tools/gpu/gpu_runtime_kv_check.cc (runtime-owned caches in CUDA memory, growing)
#      with g++ against the ExecuTorch C++ SDK unpacked from the executorch 1.5.1 cp312 wheel in
#      .whl/ and the machine's libtorch;
#   3. runs each check without and with a non-blocking caller stream, then under compute-sanitizer
#      memcheck, racecheck and synccheck.
#
#   tools/gpu/gpu_check.sh            everything (on the GPU machine: run tool, carry [".whl"])
#   GPU_CHECK_BUILD_ONLY=1 tools/gpu/gpu_check.sh   steps 2 only, for a machine without a GPU
#   GPU_CHECKS=runtime_kv tools/gpu/gpu_check.sh    only the named checks (default: runtime_kv decode)
# Logs go to $OUT (the device tool's folder) when set.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${GPU_CHECK_DIR:-/tmp/zerokv_gpu_check}
LOGS=${OUT:-$BUILD/logs}
PYTHON=${PYTHON:-python3}
mkdir -p "$LOGS"
source "$ROOT/tools/gpu/runtime_build.sh"
prepare_build
build_objects tools/gpu/gpu_decode_check.cc tools/gpu/gpu_runtime_kv_check.cc
for check in gpu_decode_check gpu_runtime_kv_check; do
  link_program "$check" "$BUILD/obj/tools_gpu_$check.cc.o" -lexecutorch
done
[[ "${GPU_CHECK_BUILD_ONLY:-0}" == 1 ]] && exit 0

CHECKS=${GPU_CHECKS:-runtime_kv decode}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ " $CHECKS " == *" decode "* ]]; then
  echo "== CUDA AOTInductor decode blob"
  time PYTHONPATH="$BUILD/py" "$PYTHON" -m zerokv.aoti.make_decode_blob "$BUILD/decode_cuda.blob" --device cuda \
    2>&1 | grep -v -e FutureWarning -e 'return cls' || true
  test -s "$BUILD/decode_cuda.blob"
fi
if [[ " $CHECKS " == *" runtime_kv "* ]]; then
  echo "== CUDA AOTInductor runtime-owned KV blob"
  time PYTHONPATH="$BUILD/py" "$PYTHON" "$ROOT/tools/gpu/make_runtime_kv_blob.py" "$BUILD/runtime_kv" --device cuda \
    2>&1 | grep -v -e FutureWarning -e 'return cls' || true
  test -s "$BUILD/runtime_kv/runtime_kv.blob"
fi

status=0
run() {  # run NAME COMMAND...: logs to $LOGS/NAME.log, keeps going on failure
  local name=$1; shift
  echo "== $name: $*"
  if "$@" >"$LOGS/$name.log" 2>&1; then echo "ok"; else echo "FAILED ($?)"; status=1; fi
  tail -n 6 "$LOGS/$name.log"
}
SANITIZER=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
for name in $CHECKS; do
  if [[ $name == decode ]]; then
    CHECK=("$BUILD/gpu_decode_check" "$BUILD/decode_cuda.blob")
  else
    CHECK=("$BUILD/gpu_runtime_kv_check" "$BUILD/runtime_kv")
  fi
  for mode in own-stream caller-stream; do
    run "${name}_${mode}" "${CHECK[@]}" "$mode"
  done
  for tool in memcheck racecheck synccheck; do
    for mode in own-stream caller-stream; do
      run "${name}_${tool}_${mode}" "$SANITIZER" --tool "$tool" --error-exitcode 9 "${CHECK[@]}" "$mode"
    done
  done
done
exit $status
