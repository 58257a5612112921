#!/usr/bin/env bash
# A runner that links only the backend core and the TensorRT engine kind links no libtorch: the
# query output (every target such a runner depends on, both branches of every select) names neither
# @zerokv_torch nor the AOTInductor engine, and does name what the runner needs.
#   links_no_torch_test.sh QUERY_OUTPUT
set -euo pipefail
deps=$1
for needed in //cc/runtime:backend //cc/engines/tensorrt:tensorrt_engine; do
  if ! grep -qx "$needed" "$deps"; then
    echo "FAIL: $deps lacks $needed: the query is not the TensorRT runner's dependencies"
    exit 1
  fi
done
if grep -E "^@zerokv_torch//|^//cc/engines/aoti:" "$deps"; then
  echo "FAIL: the TensorRT runner's dependencies (above) pull in libtorch"
  exit 1
fi
echo "PASS: the backend core and the TensorRT engine kind depend on no libtorch"
