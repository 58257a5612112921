#!/bin/bash
# Builds and tests the downstream example workspace (example/, which depends on zerokv by local path)
# with a Bazel server of its own, as a user's workspace would.
#
# The nested server cannot share this build's output base (its lock is held), so it gets an output
# user root beside it: warm across runs, removed by `bazel clean --expunge`. It is shut down at exit.
set -euo pipefail

# Runfiles are symlinks into the source tree (the test is tagged "local"): build the example in place
# so that its `local_path_override(path = "../../..")` reaches this checkout of zerokv.
example="$(dirname "$(readlink -f "$0")")/example"
output_base="${TEST_SRCDIR%%/execroot/*}"
output_user_root="$output_base/zerokv-downstream"

# Without TEST_TMPDIR, Bazel's client behaves as it does for a user (it is not running in a test).
nested_bazel() {
  (cd "$example" && env -u TEST_TMPDIR bazel --output_user_root="$output_user_root" --max_idle_secs=60 "$@")
}
trap 'nested_bazel shutdown' EXIT

# No convenience symlinks: the example lives in zerokv's source tree.
nested_bazel test --symlink_prefix=/ //...
