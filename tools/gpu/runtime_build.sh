# Sourced by the GPU scripts (gpu_check.sh, kv_decode_gpu.sh): builds zerokv's runtime with g++ on a
# machine without Bazel, against the ExecuTorch C++ SDK in the executorch 1.5.1 cp312 wheel in .whl/
# and the machine's libtorch and CUDA.
#
#   source tools/gpu/runtime_build.sh     (with ROOT, BUILD and PYTHON set)
#   prepare_build                         unpacks the SDK; sets ET, TORCH, TORCH_LIBS; generates the
#                                         blob codecs (C++ into $BUILD/gen, Python package into $BUILD/py)
#   build_objects EXTRA_SOURCE...         compiles the runtime and EXTRA_SOURCE... into $BUILD/obj
#   link_program NAME MAIN_OBJECT LIB...  links $BUILD/NAME from the runtime objects, a main, and the
#                                         ExecuTorch libraries LIB... (e.g. -lexecutorch)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

# The runtime's sources (the AOTInductor engine is compiled apart: it sees torch's c10).
RUNTIME_SOURCES=(cc/blob/blob.cc cc/engines/engine.cc cc/runtime/caller_stream.cc cc/runtime/host_device_ops.cc
                 cc/runtime/cuda_device_ops.cc cc/runtime/delegate.cc cc/runtime/backend.cc
                 cc/runtime/binding_trace.cc cc/kvcache/kv_cache.cc cc/kvcache/sequence.cc cc/kvcache/c_api.cc)

prepare_build() {
  rm -rf "$BUILD/obj"
  mkdir -p "$BUILD/obj" "$BUILD/gen/cc/blob" "$BUILD/py"
  echo "== ExecuTorch C++ SDK from the wheel"
  local wheel
  wheel=$(ls "$ROOT"/.whl/executorch-1.5.1-*.whl | head -1)
  "$PYTHON" - "$wheel" "$BUILD/et" <<'UNPACK'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
wheel.extractall(sys.argv[2], [n for n in wheel.namelist()
                               if n.startswith("executorch/include/") or n.startswith("executorch/lib/lib")])
UNPACK
  ET=$BUILD/et/executorch
  TORCH=$("$PYTHON" -c "import os, torch; print(os.path.dirname(torch.__file__))")
  ABI=$("$PYTHON" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
  TORCH_LIBS=(-ltorch -ltorch_cpu -lc10)
  local cuda_lib
  for cuda_lib in torch_cuda c10_cuda; do
    if [[ -e "$TORCH/lib/lib$cuda_lib.so" ]]; then TORCH_LIBS+=("-l$cuda_lib"); fi
  done
  echo "== generated codecs"
  (cd "$ROOT" && "$PYTHON" -m tools.blob_schema.generate --cpp "$BUILD/gen/cc/blob/blob_format.h")
  rm -rf "$BUILD/py/zerokv" && cp -r "$ROOT/py/zerokv" "$BUILD/py/zerokv"
  (cd "$ROOT" && "$PYTHON" -m tools.blob_schema.generate --python "$BUILD/py/zerokv/blob/format_generated.py")
}

_compile() {  # _compile SOURCE FLAGS...
  local source=$1; shift
  g++ -std=c++17 -O2 -g -fPIC "-D_GLIBCXX_USE_CXX11_ABI=$ABI" -DZEROKV_WITH_CUDA \
    "-I$ROOT" "-I$BUILD/gen" "-I$CUDA_HOME/include" "$@" \
    -c "$ROOT/$source" -o "$BUILD/obj/$(echo "$source" | tr / _).o"
}

build_objects() {
  echo "== build"
  local et_flags=(-DC10_USING_CUSTOM_GENERATED_MACROS -DET_EVENT_TRACER_ENABLED "-I$ET/include"
                  "-I$ET/include/executorch/runtime/core/portable_type/c10")
  local torch_flags=("-I$TORCH/include" "-I$TORCH/include/torch/csrc/api/include" "-I$ET/include")
  local pids=() source pid
  for source in "${RUNTIME_SOURCES[@]}" "$@"; do
    _compile "$source" "${et_flags[@]}" & pids+=($!)
  done
  _compile cc/engines/aoti/aoti_engine.cc "${torch_flags[@]}" & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid"; done
}

link_program() {  # link_program NAME MAIN_OBJECT ET_LIB...
  local name=$1 main=$2; shift 2
  local runtime=()
  local object
  for object in "$BUILD"/obj/*.o; do
    # Every object but the other programs' mains (tools/gpu/*.cc).
    [[ "$object" == "$BUILD"/obj/tools_gpu_* && "$object" != "$main" ]] || runtime+=("$object")
  done
  # --no-as-needed: the kernels and the engines register themselves at load; nothing names them.
  g++ -o "$BUILD/$name" "${runtime[@]}" "-L$ET/lib" -Wl,--no-as-needed "$@" \
    "-L$TORCH/lib" "${TORCH_LIBS[@]}" -Wl,--as-needed \
    "-L$CUDA_HOME/lib64" -lcudart "-Wl,-rpath,$ET/lib:$TORCH/lib:$CUDA_HOME/lib64"
  echo "built $BUILD/$name"
}
