#!/bin/bash
# zerokv's one set-up command, for a fresh Debian 12 (bookworm) x86_64 machine, run as root.
# Idempotent. Installs, from Debian, PyPI and npm only:
#   - Bazel 7.7.1 from pinned Debian sid packages, unpacked into $ZEROKV_PREFIX/bazel
#     (tools/setup/install_bazel.sh), with the `bazel` wrapper in $ZEROKV_BIN_DIR;
#   - clang 14 with its libFuzzer and sanitizer runtimes, and patchelf, from bookworm;
#   - the venv $ZEROKV_PREFIX/venv from tools/setup/requirements.lock (torch 2.13.0 CPU,
#     executorch 1.5.1, TensorRT-RTX 1.7.1.116, Triton 3.6.0, absl-py, pytest, numpy);
#   - buildifier 8.2.1 from npm;
#   - $ZEROKV_PREFIX/machine.bazelrc: the machine-level Bazel flags (which venv to use).
# With --gpu-bundle, then also prepares a run on the GPU machine (tools/gpu/prepare.sh: a
# relocatable Bazel made from this install, and the wheels that machine lacks, in .gpu/).
set -euo pipefail
case "${1:-}" in
  "" | --gpu-bundle) ;;
  *) echo "usage: tools/setup.sh [--gpu-bundle]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
prefix=${ZEROKV_PREFIX:-/opt/zerokv}
bin_dir=${ZEROKV_BIN_DIR:-/usr/local/bin}
venv=$prefix/venv
start=$(date +%s)
log() { echo "[setup +$(($(date +%s) - start))s] $*"; }

debian_packages="patchelf=0.14.3-1+b1 clang-14=1:14.0.6-12 libclang-rt-14-dev=1:14.0.6-12"
missing=""
for pin in $debian_packages; do
  [ "$(dpkg-query -W -f='${Version}' "${pin%%=*}" 2>/dev/null)" = "${pin#*=}" ] || missing="$missing $pin"
done
if [ -n "$missing" ]; then
  log "apt-get install$missing"
  apt-get update -q >/dev/null
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >/dev/null
fi

log "Bazel"
mkdir -p "$prefix"
bash "$root/tools/setup/install_bazel.sh" "$prefix" "$bin_dir"

lock=$root/tools/setup/requirements.lock
if [ ! -x "$venv/bin/python" ] || ! cmp -s <(grep -v '^#' "$lock" | sort) <("$venv/bin/pip" freeze --all --exclude pip | sort); then
  log "venv $venv from $(basename "$lock")"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # --no-deps: the lock is the whole closure, so nothing unpinned can slip in
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$lock"
  "$venv/bin/pip" check
else
  log "venv $venv matches $(basename "$lock")"
fi

buildifier_version=8.2.1
if [ "$("$bin_dir/buildifier" --version 2>/dev/null | awk '{print $3}')" != "$buildifier_version" ]; then
  log "buildifier $buildifier_version (npm)"
  npm install -q --no-audit --no-fund --prefix "$prefix/npm" "@bazel/buildifier@$buildifier_version" >/dev/null
  ln -sfn "$prefix/npm/node_modules/@bazel/buildifier/buildifier-linux_amd64" "$bin_dir/buildifier"
fi

cat >"$prefix/machine.bazelrc" <<EOF
# Written by zerokv's tools/setup.sh: what this machine provides to zerokv's build.
common --repo_env=ZEROKV_PYTHON=$venv/bin/python
common --repo_env=ZEROKV_CLANG=$(command -v clang-14)
EOF
log "done: $("$bin_dir/bazel" --version), venv $venv, $(clang-14 --version | head -1)"
if [ "${1:-}" = --gpu-bundle ]; then
  ZEROKV_PREFIX=$prefix bash "$root/tools/gpu/prepare.sh"
fi
