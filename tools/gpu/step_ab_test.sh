#!/bin/bash
# step_ab.sh refuses a bad tree, a tree given twice, ROUNDS, POSITION or VARIANTS by name, before it
# builds, deletes or exports anything, and starts each round one tree later than the round before;
# -c adds a tree; the VARIANTS choose what each tree exports (-n prints it); with -R every tree's
# runner times B's exports, so a tree needs a runner that takes the VARIANTS, not an exporter.
set -uo pipefail
step_ab=$1
tmp=${TEST_TMPDIR:-$(mktemp -d)}
export ZEROKV_GPU_DIR=$tmp/gpu
mkdir -p "$ZEROKV_GPU_DIR/step_ab" "$tmp/not_a_copy" "$tmp/old/tools/bench" "$tmp/new/tools/bench" "$tmp/new2/tools/bench"
touch "$ZEROKV_GPU_DIR/step_ab/kept"
echo 'parser.add_argument("--linear")' >"$tmp/old/tools/bench/decode_roofline_programs.py"
echo 'parser.add_argument("--programs")' >"$tmp/new/tools/bench/decode_roofline_programs.py"
cp "$tmp/new/tools/bench/decode_roofline_programs.py" "$tmp/new2/tools/bench/"
echo 'std::getenv("DECODE_ROOFLINE_VARIANTS")' >"$tmp/old/tools/bench/decode_roofline.cc"
this_tree=$(realpath "$(dirname "$step_ab")/../..")
failures=0
refuses() {  # what the message must say, then step_ab's arguments
  local expected=$1
  shift
  local output status
  output=$(bash "$step_ab" "$@" 2>&1)
  status=$?
  if [ "$status" -ne 2 ] || [[ $output != *"$expected"* ]]; then
    echo "FAIL: step_ab.sh $* exited $status, saying: $output (wanted 2 and: $expected)"
    failures=$((failures + 1))
  fi
}
refuses "usage: step_ab.sh [-c] [-n] [-R] [-r ROUNDS]"
refuses "usage: step_ab.sh [-c] [-n] [-R] [-r ROUNDS]" -x "$tmp/new"
refuses "tree '$tmp/missing' is not a folder" "$tmp/missing"
refuses "tree '$tmp/missing' is not a folder" "$tmp/new" "$tmp/missing"
refuses "$tmp/not_a_copy is not a copy of the repository" "$tmp/not_a_copy"
refuses "decode_roofline_programs.py has no --programs" "$tmp/new" "$tmp/old"
refuses "$tmp/new's decode_roofline.cc has no DECODE_ROOFLINE_VARIANTS" -R "$tmp/old" "$tmp/new"
refuses "ROUNDS 'x' is not a positive whole number" -r x "$tmp/new"
refuses "ROUNDS '0' is not a positive whole number" -r 0 "$tmp/new"
refuses "POSITIONs '256 x' are not whole numbers" -p "256 x" "$tmp/new"
refuses "VARIANTS 'static,x' are not among static, bare and runtime_owned (comma-separated)" -v static,x "$tmp/new"
refuses "VARIANTS 'static,' are not among static, bare and runtime_owned (comma-separated)" -v static, "$tmp/new"
refuses "8 trees besides this one; at most 7" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new"
refuses "8 trees besides this one; at most 7" -c "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new" "$tmp/new"
# Two exports of one tree at once would write its generated files at once.
refuses "$tmp/new is given twice (as A too): -c times a copy of BASELINE" "$tmp/new" "$tmp/new2" "$tmp/new"
refuses "$this_tree is this tree, B, which is timed anyway" "$this_tree"
plans() {  # the plan it must print, then step_ab's arguments
  local expected=$1
  shift
  local output
  output=$(bash "$step_ab" -n "$@" 2>&1)
  if [ "$?" -ne 0 ] || [ "$output" != "$expected" ]; then
    echo "FAIL: step_ab.sh -n $* printed: $output (wanted: $expected)"
    failures=$((failures + 1))
  fi
}
plans $'exports: static\nround 1: A B\nround 2: B A\nround 3: A B\nround 4: B A' -r 4 "$tmp/new"
plans $'exports: static\nround 1: A B C\nround 2: B C A\nround 3: C A B\nround 4: A B C' -r 4 "$tmp/new" "$tmp/new2"
plans $'exports: static\nround 1: A B C\nround 2: B C A\nround 3: C A B' -c "$tmp/new"
plans $'exports: static\nround 1: A B C D\nround 2: B C D A\nround 3: C D A B' -c "$tmp/new" "$tmp/new2"
plans $'exports: static\nround 1: A B\nround 2: B A\nround 3: A B' "$tmp/new"
plans $'exports: runtime_owned\nround 1: A B\nround 2: B A' -r 2 -v runtime_owned "$tmp/new"
plans $'exports: static runtime_owned\nround 1: A B\nround 2: B A' -r 2 -v bare,runtime_owned,static "$tmp/new"
plans $'exports: static\nround 1: A B\nround 2: B A' -r 2 -v bare "$tmp/new"
plans $'exports: static runtime_owned\nrunners: each tree\'s own, over B\'s exports\nround 1: A B C\nround 2: B C A' \
  -R -c -r 2 -v static,runtime_owned "$tmp/old"
[ -f "$ZEROKV_GPU_DIR/step_ab/kept" ] || { echo "FAIL: a refused run deleted the last run's folder"; failures=$((failures + 1)); }
exit $((failures > 0))
