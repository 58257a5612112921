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
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
rm -rf "$BUILD/obj" "$BUILD/main"
mkdir -p "$BUILD/obj" "$BUILD/main" "$BUILD/gen/cc/blob" "$BUILD/py" "$LOGS"

echo "== ExecuTorch C++ SDK from the wheel"
WHEEL=$(ls "$ROOT"/.whl/executorch-1.5.1-*.whl | head -1)
"$PYTHON" - "$WHEEL" "$BUILD/et" <<'UNPACK'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
wheel.extractall(sys.argv[2], [n for n in wheel.namelist()
                               if n.startswith("executorch/include/") or n == "executorch/lib/libexecutorch.so"])
UNPACK
ET=$BUILD/et/executorch
TORCH=$("$PYTHON" -c "import os, torch; print(os.path.dirname(torch.__file__))")
ABI=$("$PYTHON" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")

echo "== generated codecs"
(cd "$ROOT" && "$PYTHON" -m tools.blob_schema.generate --cpp "$BUILD/gen/cc/blob/blob_format.h")
rm -rf "$BUILD/py/zerokv" && cp -r "$ROOT/py/zerokv" "$BUILD/py/zerokv"
(cd "$ROOT" && "$PYTHON" -m tools.blob_schema.generate --python "$BUILD/py/zerokv/blob/format_generated.py")

COMMON=(-std=c++17 -O1 -g -fPIC "-D_GLIBCXX_USE_CXX11_ABI=$ABI" -DZEROKV_WITH_CUDA
        "-I$ROOT" "-I$BUILD/gen" "-I$CUDA_HOME/include")
ET_FLAGS=(-DC10_USING_CUSTOM_GENERATED_MACROS -DET_EVENT_TRACER_ENABLED "-I$ET/include"
          "-I$ET/include/executorch/runtime/core/portable_type/c10")
# The AOTI engine sees torch's c10, never ExecuTorch's portable copy of it.
TORCH_FLAGS=("-I$TORCH/include" "-I$TORCH/include/torch/csrc/api/include" "-I$ET/include")

echo "== build"
compile() {  # compile SOURCE FLAGS...: the runtime's objects to obj/, the checks' mains to main/
  local source=$1; shift
  local dir=obj
  [[ "$source" == tools/gpu/* ]] && dir=main
  g++ "${COMMON[@]}" "$@" -c "$ROOT/$source" -o "$BUILD/$dir/$(echo "$source" | tr / _).o"
}
pids=()
compile cc/blob/blob.cc & pids+=($!)
for source in cc/engines/engine.cc cc/runtime/caller_stream.cc cc/runtime/host_device_ops.cc \
              cc/runtime/cuda_device_ops.cc cc/runtime/delegate.cc cc/runtime/backend.cc \
              cc/runtime/binding_trace.cc cc/kvcache/kv_cache.cc cc/kvcache/registry.cc cc/kvcache/c_api.cc \
              tools/gpu/gpu_decode_check.cc tools/gpu/gpu_runtime_kv_check.cc; do
  compile "$source" "${ET_FLAGS[@]}" & pids+=($!)
done
compile cc/engines/aoti/aoti_engine.cc "${TORCH_FLAGS[@]}" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
TORCH_LIBS=(-ltorch -ltorch_cpu -lc10)
for cuda_lib in torch_cuda c10_cuda; do
  [[ -e "$TORCH/lib/lib$cuda_lib.so" ]] && TORCH_LIBS+=("-l$cuda_lib")
done
for check in gpu_decode_check gpu_runtime_kv_check; do
  g++ -o "$BUILD/$check" "$BUILD/main/tools_gpu_$check.cc.o" "$BUILD"/obj/*.o \
    "-L$ET/lib" -lexecutorch "-L$TORCH/lib" -Wl,--no-as-needed "${TORCH_LIBS[@]}" -Wl,--as-needed \
    "-L$CUDA_HOME/lib64" -lcudart "-Wl,-rpath,$ET/lib:$TORCH/lib:$CUDA_HOME/lib64"
  echo "built $BUILD/$check"
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
