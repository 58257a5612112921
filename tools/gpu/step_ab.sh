#!/bin/bash
# What a change does to the 1B decode step, on the GPU machine: the static step and the bare engine of
# a baseline tree and of this one, exported side by side and timed alternately on one machine.
# Between machines the step's time spreads by up to 14%; between alternating runs on one, the bare
# engine's by up to 1.4% and the static step's by up to 4%, so this is how a change of a few percent
# is measured.
#   bash tools/gpu/step_ab.sh BASELINE [ROUNDS] [POSITION...]
# BASELINE: another copy of the repository, at or after the commit that gave
# decode_roofline_programs.py its --programs (e.g. `git archive main | tar x -C .gpu/baseline`
# before the device call, with carry [".gpu"]). Builds the runner as tools/gpu/run.sh does, exports
# each tree's static program (the reference logits once, from this tree), then runs decode_roofline
# (DECODE_ROOFLINE_VARIANTS=static,bare) ROUNDS times (3) for each tree, the baseline first, at the
# POSITIONs (256 1024 4096 8192). A line per run, then each row's median over the runs, baseline and
# this tree, and their ratio; the runs' rows and the exports' logs in $OUT/step_ab.tgz (or the
# work folder's). No run starts once STEP_AB_SECONDS (480) have passed, so that a device call
# returns what it measured.
set -euo pipefail
(($#)) || { echo "usage: step_ab.sh BASELINE [ROUNDS] [POSITION...]" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$1" ] || { echo "step_ab: BASELINE '$1' is not a folder" >&2; exit 2; }
baseline=$(realpath "$1")
[ -f "$baseline/tools/bench/decode_roofline_programs.py" ] || { echo "step_ab: $baseline is not a copy of the repository" >&2; exit 2; }
grep -q -- "--programs" "$baseline/tools/bench/decode_roofline_programs.py" ||
  { echo "step_ab: $baseline's decode_roofline_programs.py has no --programs: take a later baseline" >&2; exit 2; }
rounds=${2:-3}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "step_ab: ROUNDS '$rounds' is not a positive whole number" >&2; exit 2; }
shift $(($# > 1 ? 2 : 1))
(($#)) || set -- 256 1024 4096 8192
start=$SECONDS
work=${ZEROKV_GPU_DIR:-/tmp/zerokv_gpu}/step_ab
rm -rf "$work" && mkdir -p "$work/runs"

echo "[step_ab] building the runner"
GPU_TESTS=none ROOFLINE_POSITIONS="" DECODE_ROOFLINE_PHASES=none OUT="$work" bash "$root/tools/gpu/run.sh" >"$work/build.log" 2>&1 ||
  { tail -n 20 "$work/build.log"; exit 1; }
site=${ZEROKV_GPU_DIR:-/tmp/zerokv_gpu}/site
runner=$(find -L "$root/bazel-bin/tools/bench" -maxdepth 1 -name decode_roofline_runner -type f | head -n 1)
[ -n "$runner" ] || { echo "step_ab: the build left no decode_roofline_runner" >&2; exit 1; }

echo "[step_ab] exporting both trees' static steps ($((SECONDS - start)) s)"
export_tree() {  # tree, directory, programs...
  local tree=$1 dir=$2
  shift 2
  (cd "$tree" && PYTHONPATH="$tree/py:$tree:$site" python3 tools/blob_schema/generate.py --python py/zerokv/blob/format_generated.py &&
    PYTHONPATH="$tree/py:$tree:$site" python3 tools/bench/decode_roofline_programs.py "$dir" --programs "$@")
}
export_tree "$baseline" "$work/A" static >"$work/export_A.log" 2>&1 &
baseline_export=$!
export_tree "$root" "$work/B" static reference >"$work/export_B.log" 2>&1 ||
  { tail -n 20 "$work/export_B.log"; exit 1; }
wait "$baseline_export" || { tail -n 20 "$work/export_A.log"; exit 1; }
ln -s "$work/B/reference" "$work/A/reference"

echo "[step_ab] timing, the baseline (A) and this tree (B) alternately ($((SECONDS - start)) s)"
for ((round = 1; round <= rounds; round++)); do
  for tree in A B; do
    if ((SECONDS - start >= ${STEP_AB_SECONDS:-480})); then
      echo "[step_ab] out of time before round $round's $tree"
      break 2
    fi
    rows="$work/runs/$round.$tree.tsv"
    DECODE_ROOFLINE_VARIANTS=static,bare "$runner" "$work/$tree" 64 "$@" >"$rows" 2>"$work/runs/$round.$tree.err" ||
      { tail -n 5 "$work/runs/$round.$tree.err"; exit 1; }
    echo "$tree $round: $(awk '$1 ~ /^(bare_engine|zerokv_static)$/ {printf "%s@%s %s  ", $1, $2, $3}
                                 $1 == "agreement_zerokv_static" {printf "cosine %s top-1 %s/%s", $3, $4, $5}' "$rows")"
  done
done
python3 - "$work/runs" <<'PY'
import collections, glob, os, statistics, sys
medians = collections.defaultdict(list)
for path in glob.glob(os.path.join(sys.argv[1], "*.tsv")):
    tree = path.rsplit(".", 2)[-2]
    for line in open(path):
        variant, position, median, *_ = line.split("\t")
        if variant in ("bare_engine", "zerokv_static"):
            medians[variant, int(position), tree].append(float(median))
print("| variant | position | A ms (median of runs) | B ms | B / A |")
print("| --- | ---: | ---: | ---: | ---: |")
for variant, position in sorted({key[:2] for key in medians}):
    a, b = (medians.get((variant, position, tree)) for tree in "AB")
    if a and b:
        a, b = statistics.median(a), statistics.median(b)
        print(f"| {variant} | {position} | {a:.4f} | {b:.4f} | {b / a:.3f} |")
PY
tar czf "${OUT:-$work}/step_ab.tgz" -C "$work" runs export_A.log export_B.log build.log
