#!/bin/bash
# Makes a relocatable Bazel for a machine without Java, Bazel or network (the GPU machine) from the
# Bazel that tools/setup/install_bazel.sh unpacked into PREFIX: a folder that keeps PREFIX's layout
# and holds only what Bazel 7.7.1 runs on, plus a `bazel` launcher that derives every path from
# the folder's own location (bazel_bundle/bazel, bazel_bundle/relocate.sh).
#   - a Java runtime linked with jlink from $JDK (a JDK 21+ whose runtime jlink links without jmods:
#     the machine image's Temurin 25), holding the modules jdeps finds the server using, plus
#     jdk.zipfs (a file system provider, found only at run time); class files stored, libjvm
#     stripped;
#   - Bazel's client, helpers and install base, and the jars jdeps finds reachable from the server
#     jar, the jars stored uncompressed (an outer xz compresses raw class files far better);
#   - the shared libraries those load, sid's glibc included (the server's JNI library needs it);
#   - Debian's rule sets, the offline overlay and registry (write_offline_overlay.sh), googletest's
#     sources; java_tools is an empty stand-in (no Java rules here).
# ELF interpreters point at a placeholder that relocate.sh overwrites with the bundle's own ld.so
# wherever the folder lies; RPATHs are $ORIGIN-relative.
#
# Usage: make_bazel_bundle.sh PREFIX OUT     (PREFIX: what install_bazel.sh was given, e.g. /opt/zerokv)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$1/bazel
out=$2
JDK=${JDK:-/usr/lib/jvm/temurin-25-jdk-amd64}
lib=usr/lib/x86_64-linux-gnu
helpers=usr/libexec/x86_64-linux-gnu/bazel
# As long as any path the bundle will lie at (relocate.sh refuses longer ones).
placeholder=/zerokv-bazel-bundle-interpreter/$(printf '%0200d' 0 | tr 0 x)/ld-linux-x86-64.so.2
log() { echo "[make_bazel_bundle] $*"; }

[ -x "$src/usr/bin/bazel" ] || { echo "no Bazel unpacked in $src: run tools/setup.sh first" >&2; exit 1; }
[ -x "$JDK/bin/jlink" ] && [ -x "$JDK/bin/jdeps" ] || { echo "JDK=$JDK has no jlink and jdeps" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/etc" "$out/usr/bin" "$out/$helpers" "$out/$lib/bazel" "$out/usr/share/java" "$out/usr/src/googletest"

# --- the server's jars: the closure jdeps finds from A-server.jar over Debian's classpath
classpath=$(paste -sd: "$src/usr/share/bazel/bazel_classpath_debian_depends.txt")
server=$src/usr/share/bazel/A-server.jar
jdeps=$("$JDK/bin/jdeps" --multi-release 25 -recursive -summary -cp "$classpath" "$server")
jars=$(awk -v server="$server" '$3 ~ /\.jar$/ && $3 != server {print $3}' <<<"$jdeps" | sort -u)
modules=$( (awk '$3 ~ /^(java|jdk)\./ {print $3}' <<<"$jdeps"; echo jdk.zipfs) | sort -u | paste -sd,)
log "$(wc -l <<<"$jars") jars reachable from the server; modules $modules"

# --- the Java runtime (zip-0: the outer xz compresses better than jlink's zip)
"$JDK/bin/jlink" --add-modules "$modules" --strip-debug --no-header-files --no-man-pages \
  --compress=zip-0 --output "$out/jre"
rm -rf "$out/jre/legal"  # license texts: re-add them to redistribute the bundle
strip --strip-unneeded "$out/jre/lib/server/libjvm.so"

store() {  # jar out: the same entries, stored uncompressed
  python3 - "$1" "$2" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as jar, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_STORED) as out:
    for info in jar.infolist():
        data = jar.read(info)
        info.compress_type = zipfile.ZIP_STORED
        out.writestr(info, data)
EOF
}
: >"$out/etc/jars.txt"
for jar in $jars; do
  store "$jar" "$out/usr/share/java/$(basename "$jar")"
  basename "$jar" >>"$out/etc/jars.txt"
done

# --- Bazel: client, helpers, install base (its helpers are relative symlinks into libexec)
cp -L "$src/usr/bin/bazel" "$out/usr/bin/bazel"
for helper in build-runfiles daemonize linux-sandbox process-wrapper zipper; do
  cp -L "$src/$helpers/$helper" "$out/$helpers/$helper"
done
cp -L "$src/$lib/bazel/libcpu_profiler.so" "$out/$lib/bazel/"
mkdir -p "$out/usr/share/bazel/tools"
(cd "$src/usr/share/bazel" && cp -a build-label.txt install_base_key builtins_bzl embedded_tools platforms rules \
  build-runfiles daemonize libcpu_profiler.so linux-sandbox process-wrapper "$out/usr/share/bazel/")
cp -a "$src/usr/share/bazel/tools/"{features,platforms,skylib} "$out/usr/share/bazel/tools/"
store "$server" "$out/usr/share/bazel/A-server.jar"

# --- the offline overlay and googletest's sources (its symlinks are relative), java_tools stand-in
mkdir -p "$out/usr/local/share"
cp -a "$src/usr/local/share/bazel-offline" "$out/usr/local/share/"
for part in googletest googlemock; do
  mkdir -p "$out/usr/src/googletest/$part"
  (cd "$src/usr/src/googletest/$part" && tar --exclude=./test --exclude=./samples --exclude=./docs -cf - .) |
    tar -C "$out/usr/src/googletest/$part" -xf -
done
mkdir -p "$out/$lib/bazel/java_tools"
echo "# Empty stand-in for Debian's java_tools: the bundle has no Java rules." >"$out/$lib/bazel/java_tools/BUILD"
: >"$out/$lib/bazel/java_tools/WORKSPACE"

# --- shared libraries: the closure of what the binaries, the JVM and the server's JNI library
# need, from the prefix (sid's glibc, libstdc++, grpc, protobuf, blake3, ...): the JVM runs on sid's
# glibc too, and must find none of the host's
jni=$(mktemp -d)
unzip -q -j "$server" main/native/libunix_jni.so -d "$jni"
pending=("$out/usr/bin/bazel" "$out/$helpers"/* "$out/$lib/bazel/libcpu_profiler.so" "$jni/libunix_jni.so"
  "$out/jre/bin/java" "$out/jre/lib/"*.so "$out/jre/lib/server/libjvm.so")
while ((${#pending[@]})); do
  elf=${pending[0]}
  pending=("${pending[@]:1}")
  for needed in $(readelf -d "$elf" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p') ld-linux-x86-64.so.2; do
    [ -e "$src/$lib/$needed" ] && [ ! -e "$out/$lib/$needed" ] || continue
    cp -L "$src/$lib/$needed" "$out/$lib/$needed"
    pending+=("$out/$lib/$needed")
  done
done
rm -rf "$jni"

# --- ELF: the placeholder interpreter, $ORIGIN-relative RPATHs (DT_RPATH: it also serves the
# libraries the JVM loads, the server's JNI library among them)
patch_elf() {  # path rpath
  patchelf --set-interpreter "$placeholder" --force-rpath --set-rpath "$2" "$out/$1"
}
patch_elf usr/bin/bazel "\$ORIGIN/../lib/x86_64-linux-gnu"
for helper in build-runfiles daemonize linux-sandbox process-wrapper zipper; do
  patch_elf "$helpers/$helper" "\$ORIGIN/../../../lib/x86_64-linux-gnu"
done
patch_elf jre/bin/java "\$ORIGIN:\$ORIGIN/../lib:\$ORIGIN/../../$lib"
# Where each interpreter lies in its file, for relocate.sh.
for elf in usr/bin/bazel "$helpers"/{build-runfiles,daemonize,linux-sandbox,process-wrapper,zipper} jre/bin/java; do
  python3 - "$out/$elf" "$elf" <<'EOF'
import struct, sys
data = open(sys.argv[1], "rb").read()
phoff, = struct.unpack_from("<Q", data, 0x20)
phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
for i in range(phnum):
    p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
    if p_type == 3:  # PT_INTERP
        print(sys.argv[2], p_offset, p_filesz)
EOF
done >"$out/etc/interpreters.txt"

# --- the machine rc, with the bundle's location as @B@; the GPU machine's own settings go in
# @B@/machine.bazelrc (tools/gpu/run.sh writes it)
grep -v '^try-import' "$src/etc/bazel/bazelrc.machine" | sed "s#$src#@B@#g" >"$out/etc/bazelrc.in"
echo "try-import @B@/machine.bazelrc" >>"$out/etc/bazelrc.in"
cp "$here/bazel_bundle/bazel" "$here/bazel_bundle/relocate.sh" "$out/"
chmod +x "$out/bazel" "$out/relocate.sh"

if grep -rlI "$src" "$out"; then
  echo "the bundle still names $src (above)" >&2
  exit 1
fi
log "$out: $(du -sh "$out" | cut -f1) in $(find "$out" | wc -l) files"
