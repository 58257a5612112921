#!/usr/bin/env bash
# The GPU KV-decode check under Bazel (tagged gpu): exports the example's program for CUDA, then
# decodes it on the delegate's own stream and under a non-blocking caller stream against eager.
#   kv_decode_gpu_test.sh EXPORT_BINARY CHECK_BINARY
set -euo pipefail
export_binary=$1 check_binary=$2
programs=${TEST_TMPDIR:-$(mktemp -d)}/programs
"$export_binary" "$programs" --device cuda
for mode in own-stream caller-stream; do
  "$check_binary" check "$programs/check" "$mode"
done
