#!/usr/bin/env bash
# The decode roofline bench on a CUDA GPU:
#   bazel run --config=gpu //tools/bench:decode_roofline -- OUT_DIR [POSITION...]
# Phases, each writing its figures to OUT_DIR as soon as it has them (DECODE_ROOFLINE_PHASES picks
# some, e.g. "peers report" to finish a run that was cut short):
#   zerokv  exports zerokv's programs (decode_roofline_programs.py: OUT_DIR/model.json) and times
#           them (decode_roofline: OUT_DIR/zerokv.tsv);
#   peers   times Hugging Face's decode steps and the copy bandwidth (decode_roofline_peers.py:
#           OUT_DIR/peers.tsv);
#   report  prints the table and writes it with the plot (decode_roofline_report.py:
#           OUT_DIR/decode_roofline.md, OUT_DIR/decode_roofline.png);
#   profile (not by default) times the static step's kernels one by one at the positions
#           (decode_roofline_profile.py: OUT_DIR/profile.md).
# DECODE_ROOFLINE_PROGRAMS (space-separated, e.g. "megakernel reference") exports only those programs
# (decode_roofline_programs.py --programs), DECODE_ROOFLINE_VARIANTS times only those variants
# (decode_roofline.cc).
# Positions: 256 1024 4096 8192 16384 by default.
set -euo pipefail
programs=$1 runner=$2 peers=$3 report=$4 profile=$5
shift 5
(($#)) || { echo "usage: decode_roofline OUT_DIR [POSITION...]" >&2; exit 2; }
out=$(realpath -m "$1")
shift
(($#)) || set -- 256 1024 4096 8192 16384
phases=" ${DECODE_ROOFLINE_PHASES:-zerokv peers report} "
steps=64
mkdir -p "$out"
if [[ $phases == *" zerokv "* ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # shellcheck disable=SC2086  # a list of programs
  "$programs" "$work" ${DECODE_ROOFLINE_PROGRAMS:+--programs $DECODE_ROOFLINE_PROGRAMS} >&2
  cp "$work/model.json" "$out/"
  "$runner" "$work" "$steps" "$@" | tee "$out/zerokv.tsv" >&2
fi
if [[ $phases == *" peers "* ]]; then
  "$peers" "$out/peers.tsv" --steps "$steps" --positions "$(IFS=,; echo "$*")" >&2
fi
if [[ $phases == *" report "* ]]; then
  "$report" "$out" "$out"
fi
if [[ $phases == *" profile "* ]]; then
  "$profile" "$out/profile.md" "$@"
fi
