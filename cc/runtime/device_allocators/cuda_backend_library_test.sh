#!/usr/bin/env bash
# libzerokv_backend_cuda.so has the AOTInductor engine's CUDA packages (ZEROKV_WITH_CUDA): it carries
# the engine's CUDA device selection, not its refusal of CUDA packages. Running a CUDA package needs
# a GPU: that is kv_decode_gpu_test's and the cc/runtime GPU checks' part (tagged gpu).
#   cuda_backend_library_test.sh LIBRARY
set -euo pipefail
library=$1
if grep -q "but this engine was built without CUDA" "$library"; then
  echo "FAIL: $library refuses CUDA AOTInductor packages: its engine was built without ZEROKV_WITH_CUDA"
  exit 1
fi
if ! grep -q "cannot select CUDA device" "$library"; then
  echo "FAIL: $library has no AOTInductor engine with CUDA packages"
  exit 1
fi
echo "PASS: $library has the AOTInductor engine's CUDA packages"
