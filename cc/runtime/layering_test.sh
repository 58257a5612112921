#!/usr/bin/env bash
# The C++ packages form layers (cc/base/README.md): no package depends on one above it. Visibility
# refuses most such dependencies; this also catches one on a public target (an engine kind, the
# runtime's libraries for runners).
#   layering_test.sh QUERY_OUTPUT FORBIDDEN_REGEX [QUERY_OUTPUT FORBIDDEN_REGEX ...]
set -euo pipefail
status=0
while (($#)); do
  deps=$1 forbidden=$2
  shift 2
  if [[ ! -s $deps ]]; then
    echo "FAIL: $deps is empty: the query found nothing"
    status=1
  elif grep -E "$forbidden" "$deps"; then
    echo "FAIL: $(basename "$deps") reaches the package(s) above (listed): $forbidden"
    status=1
  fi
done
((status == 0)) && echo "PASS: no package depends on one above it"
exit "$status"
