#!/bin/bash
# Writes the offline overlay of a sid Bazel unpacked in PREFIX and prints its rc lines:
#  - empty stand-ins for the modules @bazel_tools names but Debian does not package
#    (apple_support, protobuf, buildozer) and a zlib that links the host's -lz;
#  - a local registry holding googletest 1.18.0 (Debian's /usr/src/googletest with upstream's
#    target names) and rules_shell 0.4.0. A registry, unlike --override_module, costs nothing
#    for a workspace that does not use the module;
#  - an @remote_coverage_tools stand-in: @bazel_tools's test rules name it, so `bazel query
#    'deps(...)'` of any test would download it; `bazel coverage` (which needs the real one) says
#    that it is unavailable offline;
#  - Java: Debian's java_tools and the host JDK instead of downloads.
# Every path inside the overlay is relative to PREFIX, so that a copy of the prefix (the GPU
# machine's Bazel bundle, tools/setup/make_bazel_bundle.sh) works wherever it lies.
# Usage: write_offline_overlay.sh PREFIX >> bazelrc
set -euo pipefail
prefix=$1
overlay=$prefix/usr/local/share/bazel-offline
googletest_src=$prefix/usr/src/googletest
rules_shell_src=$prefix/usr/share/bazel/rules/shell
java_tools=$prefix/usr/lib/x86_64-linux-gnu/bazel/java_tools

rm -rf "$overlay"
mkdir -p "$overlay/modules" "$overlay/src/googletest" "$overlay/registry/modules"

for module in apple_support protobuf buildozer; do
  mkdir -p "$overlay/modules/$module"
  echo "module(name = \"$module\")" >"$overlay/modules/$module/MODULE.bazel"
  echo "# Empty stand-in: @bazel_tools names $module; nothing uses it offline." >"$overlay/modules/$module/BUILD.bazel"
done
# @bazel_tools uses buildozer's `buildozer_binary` extension (for `bazel mod tidy`): without it
# `bazel mod graph` fails. The stand-in's repository is empty.
cat >"$overlay/modules/buildozer/buildozer_binary.bzl" <<'EOF'
"""Stand-in for buildozer's `buildozer_binary` extension: an empty `buildozer_binary` repository."""

def _empty_repository_impl(repository_ctx):
    repository_ctx.file("BUILD.bazel", "# Empty stand-in: buildozer is not available offline.\n")

_empty_repository = repository_rule(implementation = _empty_repository_impl)

def _buildozer_binary_impl(_module_ctx):
    _empty_repository(name = "buildozer_binary")

buildozer_binary = module_extension(implementation = _buildozer_binary_impl)
EOF
mkdir -p "$overlay/modules/zlib"
echo 'module(name = "zlib")' >"$overlay/modules/zlib/MODULE.bazel"
printf 'cc_library(\n    name = "zlib",\n    linkopts = ["-lz"],\n    visibility = ["//visibility:public"],\n)\n' \
  >"$overlay/modules/zlib/BUILD.bazel"

# From $overlay/src/googletest up to $prefix/usr: usr/local/share/bazel-offline/src/googletest.
ln -sfn "../../../../../src/googletest/googletest" "$overlay/src/googletest/googletest"
ln -sfn "../../../../../src/googletest/googlemock" "$overlay/src/googletest/googlemock"
[ -f "$overlay/src/googletest/googletest/include/gtest/gtest.h" ] || { echo "no googletest in $googletest_src" >&2; exit 1; }
googletest_module='module(name = "googletest", version = "1.18.0", compatibility_level = 1)
bazel_dep(name = "rules_cc", version = "0.0.11")'
echo "$googletest_module" >"$overlay/src/googletest/MODULE.bazel"
cat >"$overlay/src/googletest/BUILD.bazel" <<'EOF'
# Upstream's target names (@googletest//:gtest, :gtest_main) over Debian's /usr/src/googletest.
load("@rules_cc//cc:defs.bzl", "cc_library")

package(default_visibility = ["//visibility:public"])

cc_library(
    name = "gtest",
    srcs = glob(
        [
            "googletest/src/*.cc",
            "googletest/src/*.h",
            "googlemock/src/*.cc",
        ],
        exclude = [
            "googletest/src/gtest-all.cc",
            "googletest/src/gtest_main.cc",
            "googlemock/src/gmock-all.cc",
            "googlemock/src/gmock_main.cc",
        ],
    ),
    hdrs = glob([
        "googletest/include/gtest/**/*.h",
        "googlemock/include/gmock/**/*.h",
    ]),
    includes = [
        "googlemock",
        "googlemock/include",
        "googletest",
        "googletest/include",
    ],
    linkopts = ["-pthread"],
)

cc_library(
    name = "gtest_main",
    srcs = ["googlemock/src/gmock_main.cc"],
    deps = [":gtest"],
)
EOF

add_to_registry() {  # name version source-dir MODULE.bazel-content
  local dir=$overlay/registry/modules/$1
  mkdir -p "$dir/$2"
  printf '{"homepage": "", "maintainers": [], "versions": ["%s"], "yanked_versions": {}}\n' "$2" >"$dir/metadata.json"
  printf '{"type": "local_path", "path": "%s"}\n' "${3#"$prefix"/}" >"$dir/$2/source.json"
  printf '%s\n' "$4" >"$dir/$2/MODULE.bazel"
}
# Sources' paths are relative to module_base_path, itself relative to the registry: the prefix.
echo '{"mirrors": [], "module_base_path": "../../../../.."}' >"$overlay/registry/bazel_registry.json"
add_to_registry googletest 1.18.0 "$overlay/src/googletest" "$googletest_module"
add_to_registry rules_shell 0.4.0 "$rules_shell_src" \
  "$(sed 's/version = "0.0.0"/version = "0.4.0"/' "$rules_shell_src/MODULE.bazel")"

coverage_tools=$overlay/repos/remote_coverage_tools
mkdir -p "$coverage_tools"
: >"$coverage_tools/WORKSPACE"
cat >"$coverage_tools/unavailable.sh" <<'EOF'
#!/bin/sh
echo "@remote_coverage_tools is a download, unavailable offline: bazel coverage does not work here" >&2
exit 1
EOF
chmod +x "$coverage_tools/unavailable.sh"
cat >"$coverage_tools/BUILD.bazel" <<'EOF'
# Stand-in for @remote_coverage_tools (tools/setup/write_offline_overlay.sh): the targets
# @bazel_tools//tools/test names, each failing with the reason when run.
package(default_visibility = ["//visibility:public"])

sh_binary(
    name = "coverage_report_generator",
    srcs = ["unavailable.sh"],
)

sh_binary(
    name = "lcov_merger",
    srcs = ["unavailable.sh"],
)
EOF

cat <<EOF
# ---- offline overlay (tools/setup/write_offline_overlay.sh) ----
common --override_module=apple_support=$overlay/modules/apple_support
common --override_module=protobuf=$overlay/modules/protobuf
common --override_module=buildozer=$overlay/modules/buildozer
common --override_module=zlib=$overlay/modules/zlib
common --registry=file://$overlay/registry
# bzlmod only: Bazel 7's WORKSPACE suffix would fetch rules_cc and rules_java from GitHub.
common --noenable_workspace
common --override_repository=bazel_tools~remote_coverage_tools_extension~remote_coverage_tools=$coverage_tools
common --override_repository=rules_java~~toolchains~remote_java_tools=$java_tools
common --override_repository=rules_java~~toolchains~remote_java_tools_linux=$java_tools
common --java_runtime_version=local_jdk
common --tool_java_runtime_version=local_jdk
common --extra_toolchains=@@rules_java~~toolchains~local_jdk//:all
EOF
