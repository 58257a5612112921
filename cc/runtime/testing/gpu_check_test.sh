#!/usr/bin/env bash
# One GPU check under Bazel (the gpu_check_test macro in gpu_check.bzl): writes the check's input
# on this machine's GPU with GENERATOR, then runs CHECK on the delegate's own stream and under a
# non-blocking caller stream, plainly and under compute-sanitizer memcheck, racecheck and synccheck.
# The test's four shards split those runs (plain, memcheck, racecheck, synccheck; each shard writes
# its own input); unsharded, one run does all. A failed run does not stop the others, so that one
# call to the scarce GPU machine reports every failure.
#
#   gpu_check_test.sh GENERATOR CHECK ARG...
#     GENERATOR OUT --device cuda        writes the input at OUT
#     CHECK ARG... MODE [SANITIZED...]   {input} in ARG stands for OUT; MODE is own-stream or
#                                        caller-stream; SANITIZED... ($GPU_CHECK_SANITIZED_ARGS)
#                                        only under compute-sanitizer ($COMPUTE_SANITIZER)
set -uo pipefail
generator=$1 check=$2
shift 2
[[ -n "${TEST_SHARD_STATUS_FILE:-}" ]] && touch "$TEST_SHARD_STATUS_FILE"
tools=(plain memcheck racecheck synccheck)
if [[ -n "${TEST_TOTAL_SHARDS:-}" ]]; then
  [[ "$TEST_TOTAL_SHARDS" == "${#tools[@]}" ]] || { echo "expected ${#tools[@]} shards, got $TEST_TOTAL_SHARDS"; exit 1; }
  tools=("${tools[$TEST_SHARD_INDEX]}")
fi
# GPU_CHECK_TOOLS="plain" (--test_env): only those, for a quick run on the GPU machine.
if [[ -n "${GPU_CHECK_TOOLS:-}" ]]; then
  read -r -a wanted <<<"$GPU_CHECK_TOOLS"
  kept=()
  for tool in "${tools[@]}"; do [[ " ${wanted[*]} " == *" $tool "* ]] && kept+=("$tool"); done
  ((${#kept[@]})) || echo "GPU_CHECK_TOOLS=\"$GPU_CHECK_TOOLS\": not ${tools[*]}, so this run checks nothing"
  tools=("${kept[@]}")
fi

input=${TEST_TMPDIR:-$(mktemp -d)}/input
echo "== $(basename "$generator") $input --device cuda"
if ! "$generator" "$input" --device cuda >"$input.log" 2>&1; then
  tail -n 40 "$input.log"
  echo "FAIL: $(basename "$generator") wrote no input"
  exit 1
fi
args=("${@//\{input\}/$input}")
read -r -a sanitized <<<"${GPU_CHECK_SANITIZED_ARGS:-}"

status=0
for tool in "${tools[@]}"; do
  for mode in own-stream caller-stream; do
    if [[ $tool == plain ]]; then
      run=("$check" "${args[@]}" "$mode")
    else
      run=("$COMPUTE_SANITIZER" --tool "$tool" --error-exitcode 9 "$check" "${args[@]}" "$mode" "${sanitized[@]}")
    fi
    echo "== $tool $mode: $(basename "$check") ${args[*]} $mode"
    if "${run[@]}"; then echo "ok: $tool $mode"; else echo "FAIL ($?): $tool $mode"; status=1; fi
  done
done
exit $status
