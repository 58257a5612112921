#!/bin/bash
# buildifier (from tools/setup.sh) in check mode over the checkout this test's source lives in.
# To fix what it reports: buildifier --lint=fix -r .
set -euo pipefail
root="$(cd "$(dirname "$(readlink -f "$0")")/../.." && pwd)"
cd "$root"
# Bazel's convenience symlinks (bazel-*) lead into the output base, not the source tree.
git ls-files --cached --others --exclude-standard \
  '*BUILD' '*BUILD.bazel' '*.BUILD' '*.bzl' '*MODULE.bazel' |
  xargs --no-run-if-empty buildifier --mode=check --lint=warn
