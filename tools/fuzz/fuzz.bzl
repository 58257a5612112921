"""libFuzzer targets built with clang (ASan + UBSan), outside the gcc C++ toolchain.

    clang_fuzzer(name, srcs, hdrs, deps)   an executable fuzzer: `bazel run :name -- [libFuzzer flags] DIR`
    fuzz_test(name, fuzzer, seeds, runs)   runs it for a bounded number of executions over seeds

`srcs` and `hdrs` are compiled with the sanitizers and coverage; `deps` are prebuilt SDKs (e.g.
@zerokv_executorch//:runtime), whose headers, defines and shared libraries are used as they are.
Both are incompatible (skipped) where no clang with libFuzzer was found (@zerokv_clang).
"""

load("@rules_cc//cc/common:cc_common.bzl", "cc_common")
load("@rules_cc//cc/common:cc_info.bzl", "CcInfo")
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

def _runfiles_dir(fuzzer, library):
    """The rpath entry, relative to the fuzzer, of `library`'s directory in the fuzzer's runfiles."""
    up = "/".join([".."] * fuzzer.short_path.count("/"))
    directory = library.short_path.rpartition("/")[0]
    return "$ORIGIN/" + (up + "/" if up else "") + directory

def _clang_fuzzer_impl(ctx):
    fuzzer = ctx.actions.declare_file(ctx.label.name)
    sdks = cc_common.merge_cc_infos(cc_infos = [dep[CcInfo] for dep in ctx.attr.deps])
    compilation = sdks.compilation_context
    libraries = [
        library.dynamic_library
        for linker_input in sdks.linking_context.linker_inputs.to_list()
        for library in linker_input.libraries
        if library.dynamic_library
    ]
    include_roots = depset([h.root.path for h in ctx.files.hdrs if h.root.path]).to_list()
    args = ctx.actions.args()
    args.add_all(_FLAGS)
    args.add("-I.")
    args.add_all(include_roots, format_each = "-I%s")
    args.add_all(compilation.defines, format_each = "-D%s")
    args.add_all(compilation.includes, format_each = "-I%s")
    args.add_all(compilation.quote_includes, format_each = "-iquote%s")
    args.add_all(compilation.system_includes, format_each = "-isystem%s")
    args.add_all(ctx.files.srcs)
    args.add_all(libraries)
    args.add_all([_runfiles_dir(fuzzer, library) for library in libraries], format_each = "-Wl,-rpath,%s")
    args.add("-o", fuzzer)
    ctx.actions.run(
        executable = ctx.executable._clang,
        arguments = [args],
        inputs = depset(ctx.files.srcs + ctx.files.hdrs + libraries, transitive = [compilation.headers]),
        outputs = [fuzzer],
        mnemonic = "ClangFuzzer",
        progress_message = "Linking libFuzzer target %{label}",
    )
    return [DefaultInfo(executable = fuzzer, files = depset([fuzzer]), runfiles = ctx.runfiles(files = libraries))]

_clang_fuzzer = rule(
    implementation = _clang_fuzzer_impl,
    executable = True,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cc"], mandatory = True),
        "hdrs": attr.label_list(allow_files = [".h"]),
        "deps": attr.label_list(providers = [CcInfo]),
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
