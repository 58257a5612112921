#!/bin/sh
# Points the Bazel bundle at where it now lies (./bazel runs this whenever etc/relocated is not the
# bundle's folder). The only absolute paths it needs: the ELF interpreter of its binaries (its own
# ld.so), the server's classpath file and the rc file.
set -eu
B=$(dirname "$(readlink -f "$0")")
ld=$B/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
while read -r elf offset size; do
  [ "${#ld}" -lt "$size" ] || { echo "relocate.sh: $B is too long a path for the bundle" >&2; exit 1; }
  { printf '%s' "$ld"; head -c $((size - ${#ld})) /dev/zero; } |
    dd of="$B/$elf" bs=1 seek="$offset" conv=notrunc status=none
done <"$B/etc/interpreters.txt"
while read -r jar; do echo "$B/usr/share/java/$jar"; done <"$B/etc/jars.txt" >"$B/usr/share/bazel/bazel_classpath_debian_depends.txt"
sed "s#@B@#$B#g" "$B/etc/bazelrc.in" >"$B/etc/bazelrc"
echo "$B" >"$B/etc/relocated"
