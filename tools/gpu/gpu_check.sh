#!/usr/bin/env bash
# The zerokv runtime's CUDA check, for the GPU machine (no Bazel, no network there):
#   1. compiles a CUDA AOTInductor decode-step blob with the machine's torch
#      (py/zerokv/aoti/make_decode_blob.py --device cuda);
#   2. builds the runtime (cc/blob, cc/engines, cc/engines/aoti with ZEROKV_WITH_CUDA, cc/runtime
#      with CUDA DeviceOps) and tools/gpu/gpu_decode_check.cc with g++ against the ExecuTorch C++
#      SDK unpacked from the executorch 1.5.1 cp312 wheel in .whl/ and the machine's libtorch;
#   3. runs the check without and with a non-blocking caller stream, then under compute-sanitizer
#      memcheck, racecheck and synccheck.
#
#   tools/gpu/gpu_check.sh            everything (on the GPU machine: run tool, carry [".whl"])
#   GPU_CHECK_BUILD_ONLY=1 tools/gpu/gpu_check.sh   steps 2 only, for a machine without a GPU
# Logs go to $OUT (the device tool's folder) when set.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${GPU_CHECK_DIR:-/tmp/zerokv_gpu_check}
LOGS=${OUT:-$BUILD/logs}
PYTHON=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$BUILD/obj" "$BUILD/gen/cc/blob" "$BUILD/py" "$LOGS"

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
compile() {  # compile SOURCE FLAGS...
  local source=$1; shift
  g++ "${COMMON[@]}" "$@" -c "$ROOT/$source" -o "$BUILD/obj/$(echo "$source" | tr / _).o"
}
pids=()
compile cc/blob/blob.cc & pids+=($!)
for source in cc/engines/engine.cc cc/runtime/caller_stream.cc cc/runtime/host_device_ops.cc \
              cc/runtime/cuda_device_ops.cc cc/runtime/delegate.cc cc/runtime/backend.cc \
              tools/gpu/gpu_decode_check.cc; do
  compile "$source" "${ET_FLAGS[@]}" & pids+=($!)
done
compile cc/engines/aoti/aoti_engine.cc "${TORCH_FLAGS[@]}" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
TORCH_LIBS=(-ltorch -ltorch_cpu -lc10)
for cuda_lib in torch_cuda c10_cuda; do
  [[ -e "$TORCH/lib/lib$cuda_lib.so" ]] && TORCH_LIBS+=("-l$cuda_lib")
done
g++ -o "$BUILD/gpu_decode_check" "$BUILD"/obj/*.o \
  "-L$ET/lib" -lexecutorch "-L$TORCH/lib" -Wl,--no-as-needed "${TORCH_LIBS[@]}" -Wl,--as-needed \
  "-L$CUDA_HOME/lib64" -lcudart "-Wl,-rpath,$ET/lib:$TORCH/lib:$CUDA_HOME/lib64"
echo "built $BUILD/gpu_decode_check"
[[ "${GPU_CHECK_BUILD_ONLY:-0}" == 1 ]] && exit 0

echo "== CUDA AOTInductor decode blob"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
time PYTHONPATH="$BUILD/py" "$PYTHON" -m zerokv.aoti.make_decode_blob "$BUILD/decode_cuda.blob" --device cuda \
  2>&1 | grep -v -e FutureWarning -e 'return cls' || true
test -s "$BUILD/decode_cuda.blob"

status=0
run() {  # run NAME COMMAND...: logs to $LOGS/NAME.log, keeps going on failure
  local name=$1; shift
  echo "== $name: $*"
  if "$@" >"$LOGS/$name.log" 2>&1; then echo "ok"; else echo "FAILED ($?)"; status=1; fi
  tail -n 6 "$LOGS/$name.log"
}
CHECK=("$BUILD/gpu_decode_check" "$BUILD/decode_cuda.blob")
run own_stream "${CHECK[@]}" own-stream
run caller_stream "${CHECK[@]}" caller-stream
SANITIZER=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
for tool in memcheck racecheck synccheck; do
  for mode in own-stream caller-stream; do
    run "${tool}_${mode}" "$SANITIZER" --tool "$tool" --error-exitcode 9 "${CHECK[@]}" "$mode"
  done
done
exit $status
