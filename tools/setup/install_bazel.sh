#!/bin/bash
# Installs Bazel 7.7.1 (Debian sid's bazel-bootstrap, bzlmod) on Debian 12 without network access
# at build time: the pinned sid .debs are unpacked into a prefix, their ELF files are pointed at the
# prefix's own glibc with patchelf, and a `bazel` wrapper selects that install base and JVM.
# Builds use the host toolchain (gcc 12, the zerokv venv, JDK 17 as local_jdk).
#
# Usage: install_bazel.sh PREFIX BIN_DIR
#   PREFIX/bazel       sid's files                 BIN_DIR/bazel   the wrapper
#   PREFIX/bazel/etc/bazel/bazelrc.machine          the machine-level rc (offline plumbing)
# Idempotent: an existing install whose stamp matches the pin file is kept.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=$1/bazel
bin_dir=$2
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
lock=$here/sid-packages.lock
roots="bazel-bootstrap=7.7.1+ds-8+b1 bazel-java-tools=13.6.1-5 bazel-rules-shell=0.4.0-1 libblake3-0=1.8.2-1 googletest=1.18.0-1"
# Closure members that are neither downloaded nor unpacked: builds use the host's compilers,
# Python and JDK (local_jdk); the server only needs sid's JRE and glibc.
skip='^(gcc|g\+\+|cpp|binutils|build-essential|make|patch|dpkg|perl|python3|libpython|libperl|libdpkg-perl|lib(asan|tsan|ubsan|lsan|hwasan|itm|quadmath|gprofng|ctf|ctf-nobfd|sframe|isl|mpc|mpfr|cc1|gcc-[0-9]+-dev|stdc\+\+-[0-9]+-dev|c6-dev|c-dev-bin|binutils|jansson|gomp)[0-9]*|linux-libc-dev|zlib1g-dev|rust-coreutils|node-|libjs-|junit4|default-jdk-headless|openjdk-[0-9]+-jdk-headless)'
stamp=$(sha256sum "$lock" "$0" "$here/write_offline_overlay.sh" | sha256sum | cut -c1-16)

log() { echo "[install_bazel] $*"; }

if [ "$(cat "$prefix/.installed" 2>/dev/null)" = "$stamp" ]; then
  log "already installed in $prefix"
else
  work=$prefix.apt
  mkdir -p "$work/lists/partial" "$work/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror sid main" >"$work/sources.list"
  : >"$work/status"
  apt_opts=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
    -o Dir::State::Lists="$work/lists" -o Dir::State::status="$work/status"
    -o Dir::Cache="$work" -o Dir::Cache::archives="$work/archives"
    -o Acquire::Check-Valid-Until=false -o APT::Install-Recommends=false
    -o APT::Architecture=amd64 -o APT::Architectures::=amd64 -o Debug::NoLocking=1)
  log "resolving $roots against sid (empty dpkg status: the host is untouched)"
  apt-get "${apt_opts[@]}" update -q >/dev/null
  # shellcheck disable=SC2086
  apt-get "${apt_opts[@]}" install -y -q --print-uris $roots >"$work/uris.txt" 2>&1 ||
    { tail -30 "$work/uris.txt"; log "sid no longer serves the pinned roots; update $lock"; exit 1; }
  grep "^'" "$work/uris.txt" | while read -r _ file _; do
    name=${file%%_*}; version=${file#*_}; version=${version%_*}; version=${version//%3a/:}
    [[ $name =~ $skip ]] || echo "$name=$version"
  done | sort >"$work/resolved.txt"
  if ! diff <(grep -v '^#' "$lock" | sort) "$work/resolved.txt" >"$work/drift.txt"; then
    cat "$work/drift.txt"
    log "sid's closure drifted from $lock (< pinned, > resolved now): refusing to install"
    exit 1
  fi
  mapfile -t wanted < <(grep -v '^#' "$lock")
  (cd "$work/archives" && apt-get "${apt_opts[@]}" download "${wanted[@]}" >"$work/download.log" 2>&1) ||
    { tail -30 "$work/download.log"; exit 1; }

  rm -rf "$prefix"; mkdir -p "$prefix"
  for deb in "$work"/archives/*.deb; do dpkg -x "$deb" "$prefix"; done
  log "unpacked ${#wanted[@]} packages into $prefix"

  # Absolute symlinks (e.g. the JDK's conf -> /etc/java-25-openjdk) point into the prefix.
  find "$prefix" -type l -lname '/*' | while read -r link; do ln -sfn "$prefix$(readlink "$link")" "$link"; done

  # ELF files use the prefix's ld.so and libraries; DT_RPATH also covers dlopen'ed JNI libraries.
  jdk=$(ls -d "$prefix"/usr/lib/jvm/java-*-openjdk-amd64 | sort -V | tail -1)
  ldso=$prefix/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
  rpath="$prefix/usr/lib/x86_64-linux-gnu:$prefix/lib/x86_64-linux-gnu:$jdk/lib:$jdk/lib/server"
  for f in "$prefix"/usr/bin/bazel "$prefix"/usr/libexec/x86_64-linux-gnu/bazel/* \
    "$prefix"/usr/lib/x86_64-linux-gnu/bazel/java_tools/bin/* "$jdk"/bin/* "$jdk"/lib/jspawnhelper "$jdk"/lib/jexec; do
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    readelf -l "$f" 2>/dev/null | grep -q 'program interpreter' || continue
    patchelf --set-interpreter "$ldso" --force-rpath --set-rpath "$rpath" "$f"
  done
  for f in "$jdk"/lib/*.so "$jdk"/lib/server/libjvm.so; do patchelf --force-rpath --set-rpath "$rpath" "$f"; done

  python3 "$here/relocate_bazel_classpath.py" "$prefix"

  # Debian's system rc (module overrides for rules_cc, rules_python, platforms, ...) re-pointed
  # at the prefix, followed by the offline overlay.
  sed -e "s#/usr/share/bazel#$prefix/usr/share/bazel#g" -e '/^try-import/d' -e '/^startup/d' \
    -e '/--sandbox_debug/d' -e '/host_javabase/d' "$prefix/etc/bazel/bazelrc" >"$prefix/etc/bazel/bazelrc.machine"
  bash "$here/write_offline_overlay.sh" "$prefix" >>"$prefix/etc/bazel/bazelrc.machine"
  echo "try-import $1/machine.bazelrc" >>"$prefix/etc/bazel/bazelrc.machine"
  rm -rf "$jdk/jmods" "$prefix/usr/share/doc" "$prefix/usr/share/man" "$work"
  echo "$stamp" >"$prefix/.installed"
fi

jdk=$(ls -d "$prefix"/usr/lib/jvm/java-*-openjdk-amd64 | sort -V | tail -1)
mkdir -p "$bin_dir"
cat >"$bin_dir/bazel" <<EOF
#!/bin/sh
# Bazel 7.7.1 from Debian sid, unpacked in $prefix by zerokv's tools/setup/install_bazel.sh
exec $prefix/usr/bin/bazel --install_base=$prefix/usr/share/bazel --trust_install_base \\
  --server_javabase=$jdk --host_jvm_args=--enable-native-access=ALL-UNNAMED \\
  --bazelrc=$prefix/etc/bazel/bazelrc.machine "\$@"
EOF
chmod +x "$bin_dir/bazel"
log "$("$bin_dir/bazel" --version) -> $bin_dir/bazel"
