#!/bin/bash
# Prepares a run of the GPU suite on the GPU machine (tools/gpu/run.sh), which has no Bazel, Java or
# network: makes the relocatable Bazel from this machine's install (tools/setup/make_bazel_bundle.sh,
# after tools/setup.sh) and downloads the wheels that machine lacks (tools/gpu/machine.pins), into
# the ignored folder .gpu/:
#   .gpu/zerokv-bazel.tar.xz   the Bazel bundle (tar, xz -9e with a 256 MiB dictionary)
#   .gpu/wheels/               the wheels, for the GPU machine's Python
# Then the device tool runs `bash tools/gpu/run.sh` with carry [".gpu"]. A call carries at most
# 64 MiB (the tree and .gpu/): this script fails when they would be more.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/tools/gpu/machine.pins"
prefix=${ZEROKV_PREFIX:-/opt/zerokv}
out=$root/.gpu
limit=$((64 << 20))
log() { echo "[gpu prepare] $*"; }

rm -rf "$out"
mkdir -p "$out/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bash "$root/tools/setup/make_bazel_bundle.sh" "$prefix" "$work/zerokv-bazel"
log "compressing the bundle"
tar -C "$work" -cf - zerokv-bazel | xz -9e --lzma2=dict=256MiB >"$out/zerokv-bazel.tar.xz"

# shellcheck disable=SC2086  # GPU_WHEELS is a list
"$prefix/venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$GPU_PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out/wheels" $GPU_WHEELS

# What the device tool sends: tracked and untracked files git does not ignore, and .gpu/.
tree=$(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
bundle=$(stat -c %s "$out/zerokv-bazel.tar.xz")
wheels=$(du -cb "$out"/wheels/*.whl | tail -1 | cut -f1)
total=$((tree + bundle + wheels))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
log "bundle $(mib "$bundle"), wheels $(mib "$wheels"), tree $(mib "$tree"): $(mib "$total") of the $(mib "$limit") a call carries"
[ "$total" -le "$limit" ] || { log "too much to carry"; exit 1; }
