"""zerokv_py_test: a py_test that runs pytest over its test files with the venv's interpreter."""

load("@rules_python//python:defs.bzl", "py_test")

def zerokv_py_test(name, srcs, deps = [], data = [], args = [], **kwargs):
    """A pytest test. Every file in `srcs` is collected; `args` go to pytest after them.

    The venv fingerprint is data, so that a change of installed packages re-runs the test.
    """
    py_test(
        name = name,
        srcs = srcs + [Label("//tools/pytest:pytest_main.py")],
        main = Label("//tools/pytest:pytest_main.py"),
        args = ["$(location %s)" % src for src in srcs] + args,
        deps = deps,
        data = data + [Label("@zerokv_python//:fingerprint")],
        **kwargs
    )
