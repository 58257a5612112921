#!/bin/bash
# What changes do to the 1B decode step, on the GPU machine: the static step and the bare engine of
# a baseline tree, of this one and of any other trees, exported side by side and timed alternately
# on one machine. Between machines the step's time spreads by up to 14%; between alternating runs
# on one, the bare engine's by up to 1.4% and the static step's by up to 4%, so this is how a change
# of a few percent is measured. With the trees always in one order, the one timed after the baseline
# measured 0.5-1.0% faster where the two trees' kernels did the same work
# (tools/bench/results/h200/balanced_tiles_ab_9c9a669.md), so each round starts one tree later than
# the round before (A B, B A, ...); with ROUNDS a multiple of the trees, every tree is timed in
# every place as often.
# Two copies of one source, each exported on its own (Inductor tunes its kernels on the device at
# each export), differed by 0.4-0.7% (bare engine) and up to 1.6% (static step)
# (tools/bench/results/h200/pipelined_sweep_ab_1839272.md), and in one call by 13-18%, one slower
# in every run, for a reason not found (combo_kernels_ab_9205014.md): -c shows the floor in the
# same call, and a change should beat the copy too.
#   bash tools/gpu/step_ab.sh [-c] [-n] [-R] [-r ROUNDS] [-p "POSITION..."] [-v VARIANTS] BASELINE [OTHER...]
# -c: time a copy of BASELINE as well, made on the GPU machine, named after the OTHERs.
# -R: the trees differ in the runtime (the C++ around the engine), not in what they export: each
#   tree's own runner, built from it, times the programs this tree exports, so that every tree runs
#   the same engine files and the export's noise is out of the comparison. Without it one runner,
#   this tree's, times each tree's own exports: the runtime's code is this tree's for all of them.
# -n: print the programs each tree exports and each round's order, and stop, having checked the
#   arguments.
# -v: what to time, comma-separated among static, bare and runtime_owned (static,bare): the
#   runtime-owned program decodes from position 0 through the last POSITION in each run, so that a
#   change to the runtime's host work shows (its row at each POSITION is the 64 steps from it).
# BASELINE and each OTHER: another copy of the repository, at or after the commit that gave
# decode_roofline_programs.py its --programs (with -R, decode_roofline.cc its
# DECODE_ROOFLINE_VARIANTS), e.g. `git archive main | tar x -C .gpu/baseline` before the device
# call, with carry [".gpu"]. The trees are named A (BASELINE), B (this tree), then C, D... (the
# OTHERs, in order). No tree may be given twice, nor this one: one tree's exports at once would
# write its generated files at once. Builds the runner as tools/gpu/run.sh does (with -R, each
# tree's, while B exports), exports the programs the VARIANTS time from each tree in parallel (with
# -R, from B alone; the reference logits once, from B), then runs decode_roofline
# (DECODE_ROOFLINE_VARIANTS=VARIANTS) ROUNDS times (3) for each tree, at the POSITIONs (256 1024
# 4096 8192). A line per run, then each row's median over the runs for every tree and its ratio to
# A's; the runs' rows, the exports' and builds' logs and each static engine's files with their
# hashes (tools/bench/engine_fingerprint.py; how many differ from A's is printed) in
# $OUT/step_ab.tgz (or the work folder's). No run starts once STEP_AB_SECONDS (480) have passed,
# so that a device call returns what it measured.
set -euo pipefail
usage="usage: step_ab.sh [-c] [-n] [-R] [-r ROUNDS] [-p \"POSITION...\"] [-v VARIANTS] BASELINE [OTHER...]"
rounds=3
positions="256 1024 4096 8192"
variants=static,bare
plan_only=false
copy_baseline=false
runtimes=false
while getopts "cnRr:p:v:" option; do
  case $option in
    c) copy_baseline=true ;;
    n) plan_only=true ;;
    R) runtimes=true ;;
    r) rounds=$OPTARG ;;
    p) positions=$OPTARG ;;
    v) variants=$OPTARG ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
(($#)) || { echo "$usage" >&2; exit 2; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "step_ab: ROUNDS '$rounds' is not a positive whole number" >&2; exit 2; }
[[ $positions =~ ^[0-9]+( [0-9]+)*$ ]] || { echo "step_ab: POSITIONs '$positions' are not whole numbers" >&2; exit 2; }
variant="(static|bare|runtime_owned)"
[[ $variants =~ ^$variant(,$variant)*$ ]] ||
  { echo "step_ab: VARIANTS '$variants' are not among static, bare and runtime_owned (comma-separated)" >&2; exit 2; }
programs=()  # what each tree exports for the VARIANTS (the bare engine runs the static program)
[[ ,$variants, =~ ,(static|bare), ]] && programs+=(static)
[[ ,$variants, == *,runtime_owned,* ]] && programs+=(runtime_owned)
root=$(realpath "$(dirname "$0")/../..")
labels=(A C D E F G H)  # B is this tree
others=$#
$copy_baseline && others=$((others + 1))
((others <= ${#labels[@]})) || { echo "step_ab: $others trees besides this one; at most ${#labels[@]}" >&2; exit 2; }
declare -A trees=([B]=$root)
for ((index = 0; index < $#; index++)); do
  tree=${*:index + 1:1}
  [ -d "$tree" ] || { echo "step_ab: tree '$tree' is not a folder" >&2; exit 2; }
  tree=$(realpath "$tree")
  [ "$tree" != "$root" ] || { echo "step_ab: $tree is this tree, B, which is timed anyway" >&2; exit 2; }
  [ -f "$tree/tools/bench/decode_roofline_programs.py" ] || { echo "step_ab: $tree is not a copy of the repository" >&2; exit 2; }
  if $runtimes; then
    grep -qs "DECODE_ROOFLINE_VARIANTS" "$tree/tools/bench/decode_roofline.cc" ||
      { echo "step_ab: $tree's decode_roofline.cc has no DECODE_ROOFLINE_VARIANTS: take a later copy" >&2; exit 2; }
  else
    grep -q -- "--programs" "$tree/tools/bench/decode_roofline_programs.py" ||
      { echo "step_ab: $tree's decode_roofline_programs.py has no --programs: take a later copy" >&2; exit 2; }
  fi
  for name in "${!trees[@]}"; do
    [ "${trees[$name]}" != "$tree" ] ||
      { echo "step_ab: $tree is given twice (as $name too): -c times a copy of BASELINE" >&2; exit 2; }
  done
  trees[${labels[index]}]=$tree
done
work=${ZEROKV_GPU_DIR:-/tmp/zerokv_gpu}/step_ab
if $copy_baseline; then
  copy=${labels[$#]}
  trees[$copy]=$work/copy_of_A
fi
order=$(printf "%s\n" "${!trees[@]}" | sort | tr "\n" " ")
order=${order% }
read -r -a names <<<"$order"
round_order() {  # round (from 1): the trees, starting round - 1 places later than A
  local first=$((($1 - 1) % ${#names[@]}))
  local rotated=("${names[@]:first}" "${names[@]:0:first}")
  echo "${rotated[*]}"
}
exporters=$order  # the trees that export; with -R, B alone, whose programs every runner times
$runtimes && exporters=B
if $plan_only; then
  echo "exports: ${programs[*]}"
  $runtimes && echo "runners: each tree's own, over B's exports"
  for ((round = 1; round <= rounds; round++)); do echo "round $round: $(round_order "$round")"; done
  exit 0
fi
start=$SECONDS
rm -rf "$work" && mkdir -p "$work/runs"
if $copy_baseline; then
  cp -a "${trees[A]}" "$work/copy_of_A"
  echo "[step_ab] $copy is a copy of A"
fi

echo "[step_ab] building the runner"
GPU_TESTS=none ROOFLINE_POSITIONS="" DECODE_ROOFLINE_PHASES=none OUT="$work" bash "$root/tools/gpu/run.sh" >"$work/build.log" 2>&1 ||
  { tail -n 20 "$work/build.log"; exit 1; }
site=${ZEROKV_GPU_DIR:-/tmp/zerokv_gpu}/site
declare -A runners
find_runner() {  # tree: its built decode_roofline_runner
  local found
  found=$(find -L "$1/bazel-bin/tools/bench" -maxdepth 1 -name decode_roofline_runner -type f | head -n 1)
  [ -n "$found" ] || { echo "step_ab: the build left no decode_roofline_runner in $1" >&2; return 1; }
  echo "$found"
}
runners[B]=$(find_runner "$root")
build_runners() {  # every other tree's runner, built as run.sh built B's (optimized, --config=gpu)
  local bazel=${ZEROKV_GPU_DIR:-/tmp/zerokv_gpu}/zerokv-bazel/bazel name
  for name in $order; do
    [ "$name" != B ] || continue
    (cd "${trees[$name]}" &&
      "$bazel" build --config=gpu --compilation_mode=opt --disk_cache="$work/disk_cache" //tools/bench:decode_roofline_runner &&
      "$bazel" shutdown) >"$work/build_$name.log" 2>&1 || { echo "[step_ab] $name's runner did not build:"; tail -n 20 "$work/build_$name.log"; return 1; }
  done
}
if $runtimes; then
  echo "[step_ab] building every other tree's runner while B exports"
  build_runners &
  building=$!
else
  for name in $order; do runners[$name]=${runners[B]}; done
fi

echo "[step_ab] exporting ${programs[*]} from $exporters ($((SECONDS - start)) s)"
export_tree() {  # tree, directory, programs...
  local tree=$1 dir=$2
  shift 2
  (cd "$tree" && PYTHONPATH="$tree/py:$tree:$site" python3 tools/blob_schema/generate.py --python py/zerokv/blob/format_generated.py &&
    PYTHONPATH="$tree/py:$tree:$site" python3 tools/bench/decode_roofline_programs.py "$dir" --programs "$@")
}
declare -A exports
for name in $exporters; do
  exported=("${programs[@]}")
  [ "$name" = B ] && exported+=(reference)
  export_tree "${trees[$name]}" "$work/$name" "${exported[@]}" >"$work/export_$name.log" 2>&1 &
  exports[$name]=$!
done
for name in $exporters; do
  wait "${exports[$name]}" || { echo "[step_ab] $name's export failed:"; tail -n 20 "$work/export_$name.log"; exit 1; }
  [ "$name" = B ] || ln -s "$work/B/reference" "$work/$name/reference"
done
if $runtimes; then
  wait "$building" || exit 1
  for name in $order; do
    [ "$name" = B ] || runners[$name]=$(find_runner "${trees[$name]}")
  done
fi
fingerprints=()
if [[ " ${programs[*]} " == *" static "* ]]; then
  for name in $exporters; do
    PYTHONPATH="$root/py:$root:$site" python3 "$root/tools/bench/engine_fingerprint.py" "$work/$name/static/engine.blob" \
      >"$work/engine_$name.txt" &&
      fingerprints+=("engine_$name.txt") || echo "[step_ab] $name's engine could not be fingerprinted"
  done
  for name in $exporters; do
    [[ $name != A && " ${fingerprints[*]} " == *" engine_A.txt "* && " ${fingerprints[*]} " == *" engine_$name.txt "* ]] ||
      continue
    differ=$(comm -13 <(sort "$work/engine_A.txt") <(sort "$work/engine_$name.txt") | wc -l)
    echo "[step_ab] $name's engine: $differ of $(wc -l <"$work/engine_$name.txt") files differ from A's"
  done
fi

echo "[step_ab] timing $order in turn, each round starting one later ($((SECONDS - start)) s)"
for ((round = 1; round <= rounds; round++)); do
  for name in $(round_order "$round"); do
    if ((SECONDS - start >= ${STEP_AB_SECONDS:-480})); then
      echo "[step_ab] out of time before round $round's $name"
      break 2
    fi
    rows="$work/runs/$round.$name.tsv"
    # shellcheck disable=SC2086  # the positions are words
    programs_of=$name
    $runtimes && programs_of=B
    DECODE_ROOFLINE_VARIANTS=$variants "${runners[$name]}" "$work/$programs_of" 64 $positions >"$rows" 2>"$work/runs/$round.$name.err" ||
      { tail -n 5 "$work/runs/$round.$name.err"; exit 1; }
    echo "$name $round: $(awk '$1 ~ /^(bare_engine|zerokv_static|zerokv_runtime_owned)$/ {printf "%s@%s %s  ", $1, $2, $3}
                               $1 ~ /^agreement_/ {printf "%s cosine %s top-1 %s/%s  ", substr($1, 11), $3, $4, $5}' "$rows")"
  done
done
python3 - "$work/runs" $order <<'PY'
import collections, glob, os, statistics, sys
runs, names = sys.argv[1], sys.argv[2:]
medians = collections.defaultdict(list)
for path in glob.glob(os.path.join(runs, "*.tsv")):
    tree = path.rsplit(".", 2)[-2]
    for line in open(path):
        variant, position, median, *_ = line.split("\t")
        if variant in ("bare_engine", "zerokv_static", "zerokv_runtime_owned"):
            medians[variant, int(position), tree].append(float(median))
others = names[1:]
print("| variant | position | A ms (median of runs) | " + " | ".join(f"{name} ms | {name} / A" for name in others) + " |")
print("| --- | ---: | ---: | " + " | ".join("---: | ---:" for _ in others) + " |")
for variant, position in sorted({key[:2] for key in medians}):
    a = medians.get((variant, position, "A"))
    if not a:
        continue
    a = statistics.median(a)
    cells = []
    for name in others:
        got = medians.get((variant, position, name))
        cells += [f"{statistics.median(got):.4f}", f"{statistics.median(got) / a:.3f}"] if got else ["", ""]
    print(f"| {variant} | {position} | {a:.4f} | " + " | ".join(cells) + " |")
PY
# shellcheck disable=SC2086  # the names are words
tar czf "${OUT:-$work}/step_ab.tgz" -C "$work" runs build.log $(for name in $exporters; do echo "export_$name.log"; done) \
  $($runtimes && for name in $order; do [ "$name" = B ] || echo "build_$name.log"; done) "${fingerprints[@]}"
