#!/bin/bash
# The relocatable Bazel (make_bazel_bundle.sh) works detached, as on the GPU machine: made from
# this machine's install ($ZEROKV_PREFIX, else /opt/zerokv), copied into a fresh folder, and run
# with no Java (the JDKs hidden, none on PATH), no network (a network namespace with loopback
# only), an empty environment and the install it came from hidden, it builds and passes zerokv's
# //cc/blob:blob_test (googletest from the bundle's registry, the Python of the machine's rc, which
# tools/setup.sh writes, for the fixtures). And where it finds no CUDA toolkit, --config=gpu (the
# GPU machine's `bazel test --config=gpu //...`) fails, naming it, rather than skip every GPU target.
# Runs as root (mount and network namespaces); tagged local, so that $0 resolves into the checkout.
set -euo pipefail
prefix=${ZEROKV_PREFIX:-/opt/zerokv}
workspace=$(cd "$(dirname "$(readlink -f "$0")")/../.." && pwd)
tmp=${TEST_TMPDIR:-$(mktemp -d)}

bash "$workspace/tools/setup/make_bazel_bundle.sh" "$prefix" "$tmp/made/zerokv-bazel"
mkdir -p "$tmp/fresh" "$tmp/home"
tar -C "$tmp/made" -cf - zerokv-bazel | tar -C "$tmp/fresh" -xf -
rm -rf "$tmp/made"
bundle=$tmp/fresh/zerokv-bazel
grep -e '--repo_env=ZEROKV_PYTHON=' "$prefix/machine.bazelrc" >"$bundle/machine.bazelrc"

# The Bazel client and server talk over loopback: up in the namespace, the only link there.
unshare --mount --net --propagation private \
  env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$tmp/home" \
  bash -euo pipefail -c '
    prefix=$1 bundle=$2 root=$3 workspace=$4 no_cuda_log=$3/no_cuda.log
    ip link set lo up
    mount -t tmpfs none "$prefix/bazel"
    mount -t tmpfs none /usr/lib/jvm
    if command -v java; then echo "java is still on PATH" >&2; exit 1; fi
    cd "$workspace"
    bazel() { "$bundle/bazel" --output_user_root="$root" "$@"; }
    status=0
    bazel test --symlink_prefix=/ //cc/blob:blob_test || status=$?
    if bazel build --nobuild --symlink_prefix=/ --config=gpu --repo_env=CUDA_HOME=/nonexistent \
      //cc/runtime/... >"$no_cuda_log" 2>&1; then
      echo "FAIL: --config=gpu passed without a CUDA toolkit" >&2
      status=1
    elif ! grep -q "needs the CUDA toolkit, which is not found" "$no_cuda_log"; then
      cat "$no_cuda_log" >&2
      echo "FAIL: --config=gpu without a CUDA toolkit failed for another reason" >&2
      status=1
    fi
    bazel shutdown
    exit $status
  ' bundle_test "$prefix" "$bundle" "$tmp/root" "$workspace"
