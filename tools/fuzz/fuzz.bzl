"""libFuzzer targets built with clang (ASan + UBSan), outside the gcc C++ toolchain.

    clang_fuzzer(name, srcs, hdrs)   an executable fuzzer: `bazel run :name -- [libFuzzer flags] DIR`
    fuzz_test(name, fuzzer, seeds, runs)   runs it for a bounded number of executions over seeds

Both are incompatible (skipped) where no clang with libFuzzer was found (@zerokv_clang).
"""

load("@rules_shell//shell:sh_test.bzl", "sh_test")
load("@zerokv_clang//:defs.bzl", CLANG_COMPATIBLE_WITH = "COMPATIBLE_WITH")

_FLAGS = [
    "--driver-mode=g++",
    "-std=c++17",
    "-g",
    "-O1",
    "-fno-omit-frame-pointer",
    "-fsanitize=fuzzer,address,undefined",
    "-fno-sanitize-recover=all",
]

def _clang_fuzzer_impl(ctx):
    fuzzer = ctx.actions.declare_file(ctx.label.name)
    include_roots = depset([h.root.path for h in ctx.files.hdrs if h.root.path]).to_list()
    args = ctx.actions.args()
    args.add_all(_FLAGS)
    args.add("-I.")
    args.add_all(include_roots, format_each = "-I%s")
    args.add_all(ctx.files.srcs)
    args.add("-o", fuzzer)
    ctx.actions.run(
        executable = ctx.executable._clang,
        arguments = [args],
        inputs = ctx.files.srcs + ctx.files.hdrs,
        outputs = [fuzzer],
        mnemonic = "ClangFuzzer",
        progress_message = "Linking libFuzzer target %{label}",
    )
    return [DefaultInfo(executable = fuzzer, files = depset([fuzzer]))]

_clang_fuzzer = rule(
    implementation = _clang_fuzzer_impl,
    executable = True,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cc"], mandatory = True),
        "hdrs": attr.label_list(allow_files = [".h"]),
        "_clang": attr.label(default = Label("@zerokv_clang//:clang"), executable = True, cfg = "exec", allow_single_file = True),
    },
)

def clang_fuzzer(name, **kwargs):
    _clang_fuzzer(name = name, target_compatible_with = CLANG_COMPATIBLE_WITH, **kwargs)

def fuzz_test(name, fuzzer, seeds, runs, **kwargs):
    """Runs `fuzzer` for `runs` executions from a copy of the `seeds` directory (fixed seed)."""
    sh_test(
        name = name,
        srcs = [Label("//tools/fuzz:run_fuzzer.sh")],
        args = [
            "$(rootpath %s)" % fuzzer,
            "$(rootpath %s)" % seeds,
            str(runs),
        ],
        data = [
            fuzzer,
            seeds,
        ],
        target_compatible_with = CLANG_COMPATIBLE_WITH,
        **kwargs
    )
