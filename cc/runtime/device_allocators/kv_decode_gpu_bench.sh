#!/usr/bin/env bash
# The decode bench on a CUDA GPU: exports the bench decoder at each context length and times eager
# PyTorch there (kv_decode_gpu_export.py --contexts), then `kv_decode_gpu bench` prints the table.
#   bazel run --config=gpu //cc/runtime/device_allocators:kv_decode_gpu_bench -- CONTEXT...
set -euo pipefail
export_binary=$1 check_binary=$2
shift 2
(($#)) || { echo "usage: kv_decode_gpu_bench CONTEXT... (e.g. 256 1024 4096 8192)" >&2; exit 2; }
programs=$(mktemp -d)
trap 'rm -rf "$programs"' EXIT
"$export_binary" "$programs" --device cuda --contexts "$(IFS=,; echo "$*")" >&2
"$check_binary" bench "$programs/bench" "$@"
