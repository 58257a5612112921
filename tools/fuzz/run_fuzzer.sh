#!/bin/bash
# run_fuzzer.sh FUZZER SEED_DIR RUNS: a bounded libFuzzer run over a writable copy of the seeds.
set -euo pipefail
fuzzer=$1 seeds=$2 runs=$3
corpus=${TEST_TMPDIR:-$(mktemp -d)}/corpus
mkdir -p "$corpus"
cp "$seeds"/*.blob "$corpus"/
"$fuzzer" -runs="$runs" -seed=1 -print_final_stats=1 "$corpus" 2>&1 | tail -25
