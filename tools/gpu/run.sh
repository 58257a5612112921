#!/bin/bash
# The GPU suite, on the GPU machine (no Bazel, Java or network there), from what tools/gpu/prepare.sh
# left in .gpu/: checks the machine against tools/gpu/machine.pins, unpacks the Bazel bundle,
# installs the wheels into a folder on PYTHONPATH, writes the bundle's machine rc and runs
#   bazel test --config=gpu //...          (or: bash tools/gpu/run.sh TARGET...)
# and, with KV_BENCH_CONTEXTS="256 1024 ...", the decode bench at those context lengths
# (//cc/runtime/device_allocators:kv_decode_gpu_bench, its table in $OUT/bench.md); with
# ROOFLINE_POSITIONS set ("" for the defaults), the 1B decode roofline bench
# (//tools/bench:decode_roofline: table, plot and figures in $OUT/roofline/; DECODE_ROOFLINE_PHASES
# passes through). GPU_TESTS=none runs the benches alone.
# Device tool: `bash tools/gpu/run.sh` with carry [".gpu"]. Bazel's output goes to $OUT/bazel.log and
# every test's log to $OUT/tests.log when $OUT is set (the device tool's folder), else to
# /tmp/zerokv_gpu/logs; the last line is `N passed, N failed, N skipped`.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/tools/gpu/machine.pins"
work=${ZEROKV_GPU_DIR:-/tmp/zerokv_gpu}
logs=${OUT:-$work/logs}
mkdir -p "$work" "$logs"
fail() { echo "[gpu run] $*" >&2; exit 1; }

python=$(command -v python3) || fail "no python3 on PATH"
cc=$(command -v "$GPU_CC") || fail "no $GPU_CC on PATH"
python_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
torch_version=$("$python" -c 'import torch; print(torch.__version__)')
[ "$python_version" = "$GPU_PYTHON_VERSION" ] || fail "$python is Python $python_version, not $GPU_PYTHON_VERSION (machine.pins)"
[ "$torch_version" = "$GPU_TORCH_VERSION" ] || fail "$python has torch $torch_version, not $GPU_TORCH_VERSION (machine.pins)"
echo "[gpu run] $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); Python $python_version, torch $torch_version, $("$cc" --version | head -1)"

rm -rf "$work/zerokv-bazel" "$work/site"
tar -C "$work" -xJf "$root/.gpu/zerokv-bazel.tar.xz"
"$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
  --target "$work/site" "$root"/.gpu/wheels/*.whl
cat >"$work/zerokv-bazel/machine.bazelrc" <<RC
# Written by tools/gpu/run.sh: this GPU machine, as tools/gpu/machine.pins describes it.
common --repo_env=ZEROKV_PYTHON=$python
common --repo_env=CC=$cc
common --repo_env=PYTHONPATH=$work/site
common --action_env=PYTHONPATH=$work/site
common --test_env=PYTHONPATH=$work/site
# Under linux-sandbox, compiles there do not see the external repositories' sources.
common --spawn_strategy=processwrapper-sandbox
RC

cd "$root"
bazel=$work/zerokv-bazel/bazel
status=0
if [ "${GPU_TESTS:-}" != none ]; then
  "$bazel" test --config=gpu --build_event_json_file="$work/bep.json" "${@:-//...}" >"$logs/bazel.log" 2>&1 || status=$?
  tail -n 30 "$logs/bazel.log"
  testlogs=$("$bazel" info bazel-testlogs 2>/dev/null)
  find "$testlogs" -name test.log -print0 2>/dev/null | sort -z | while IFS= read -r -d '' test_log; do
    echo "===== ${test_log#"$testlogs"/}"
    cat "$test_log"
  done >"$logs/tests.log"
fi
if [ -n "${KV_BENCH_CONTEXTS:-}" ]; then
  # shellcheck disable=SC2086  # a list of context lengths
  # `bazel run` gives the binary this shell's environment, not the rc's action or test environment.
  PYTHONPATH=$work/site "$bazel" run --config=gpu //cc/runtime/device_allocators:kv_decode_gpu_bench -- $KV_BENCH_CONTEXTS \
    >"$logs/bench.md" 2>"$logs/bench.log" || { echo "[gpu run] the bench failed (bench.log)"; status=1; }
  cat "$logs/bench.md"
fi
if [ -n "${ROOFLINE_POSITIONS+set}" ]; then
  # shellcheck disable=SC2086  # a list of positions
  PYTHONPATH=$work/site "$bazel" run --config=gpu //tools/bench:decode_roofline -- "$logs/roofline" $ROOFLINE_POSITIONS \
    >"$logs/roofline.log" 2>&1 || { echo "[gpu run] the roofline bench failed (roofline.log)"; tail -n 40 "$logs/roofline.log"; status=1; }
  cat "$logs/roofline/decode_roofline.md" 2>/dev/null || true
fi
"$bazel" shutdown
if [ "${GPU_TESTS:-}" != none ]; then
  python3 "$root/tools/ci/summarize_bep.py" "$work/bep.json" || status=1
fi
exit $status
