"""zerokv_py_test: a py_test that runs pytest over its test files with the venv's interpreter;
zerokv_triton_py_test: the same twice for Triton kernels, interpreted and on a GPU."""

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

def zerokv_triton_py_test(name, srcs, **kwargs):
    """A pytest test of Triton kernels, run twice: interpreted on the CPU and compiled on a GPU.

    Args:
      name: the interpreted test (TRITON_INTERPRET=1, set before Triton is imported); ends in
        `_test`. The GPU one is named with `_gpu_test` instead and tagged `gpu`
        (`bazel test --config=gpu //...`).
      srcs: the test files, as for zerokv_py_test.
      **kwargs: the rest of zerokv_py_test's arguments, for both.
    """
    if not name.endswith("_test"):
        fail("zerokv_triton_py_test: %s does not end in _test" % name)
    zerokv_py_test(name = name, srcs = srcs, env = {"TRITON_INTERPRET": "1"}, **kwargs)
    gpu_kwargs = dict(kwargs)
    gpu_kwargs["tags"] = kwargs.get("tags", []) + ["gpu"]
    zerokv_py_test(name = name[:-len("_test")] + "_gpu_test", srcs = srcs, **gpu_kwargs)
