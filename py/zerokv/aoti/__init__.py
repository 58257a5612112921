"""The AOTInductor engine kind: compile a partition into the payload the C++ AOTI engine runs.

    build = compile_aoti(exported_program, example_inputs, device="cpu")
    build.payload, build.bindings, build.aliased_io, build.constants  # -> zerokv.blob.Blob(engine_kind=AOTI, ...)
    build.named_data                                                    # -> ExecuTorch's named data (the weights)
"""

from zerokv.aoti.compile import (
    NAMED_DATA_ALIGNMENT,
    AotiCompileError,
    EngineBuild,
    add_constant,
    binding_table,
    compile_aoti,
    named_data_key,
)

__all__ = ["NAMED_DATA_ALIGNMENT", "AotiCompileError", "EngineBuild", "add_constant", "binding_table", "compile_aoti",
           "named_data_key"]
