"""tsan_test: a cc_test rebuilt under ThreadSanitizer (gcc's -fsanitize=thread), run as a test.

    tsan_test(name = "foo_tsan_test", test = ":foo_test")

The test and every C++ library it builds from source are compiled and linked with
-fsanitize=thread in a configuration of their own; prebuilt libraries (ExecuTorch's) stay
uninstrumented, so their own memory accesses are not checked. A race makes the test fail
(halt_on_error), with both stacks in its log.
"""

_FLAGS = ["-fsanitize=thread", "-fno-omit-frame-pointer", "-g", "-O1"]

def _tsan_transition_impl(settings, _attr):
    return {
        "//command_line_option:copt": settings["//command_line_option:copt"] + _FLAGS,
        "//command_line_option:linkopt": settings["//command_line_option:linkopt"] + ["-fsanitize=thread"],
    }

_tsan_transition = transition(
    implementation = _tsan_transition_impl,
    inputs = ["//command_line_option:copt", "//command_line_option:linkopt"],
    outputs = ["//command_line_option:copt", "//command_line_option:linkopt"],
)

def _tsan_test_impl(ctx):
    test = ctx.attr.test[0][DefaultInfo]
    executable = ctx.actions.declare_file(ctx.label.name)
    ctx.actions.write(
        output = executable,
        is_executable = True,
        content = "#!/bin/bash\nexec \"${{TEST_SRCDIR:-$0.runfiles}}/{workspace}/{test}\" \"$@\"\n".format(
            workspace = ctx.workspace_name,
            test = test.files_to_run.executable.short_path,
        ),
    )
    runfiles = ctx.runfiles(files = [executable]).merge(test.default_runfiles)
    return [
        DefaultInfo(executable = executable, runfiles = runfiles),
        RunEnvironmentInfo(environment = {"TSAN_OPTIONS": "halt_on_error=1 second_deadlock_stack=1"}),
    ]

tsan_test = rule(
    implementation = _tsan_test_impl,
    test = True,
    attrs = {
        "test": attr.label(cfg = _tsan_transition, executable = True, mandatory = True),
        "_allowlist_function_transition": attr.label(
            default = "@bazel_tools//tools/allowlists/function_transition_allowlist",
        ),
    },
)
