"""The AOTInductor engine kind: compile a partition into the payload the C++ AOTI engine runs.

    build = compile_aoti(exported_program, example_inputs, device="cpu")
    build.payload, build.bindings, build.aliased_io   # -> zerokv.blob.Blob(engine_kind=AOTI, ...)
"""

from zerokv.aoti.compile import AotiCompileError, EngineBuild, compile_aoti

__all__ = ["AotiCompileError", "EngineBuild", "compile_aoti"]
