"""Keeps AOTInductor's C++ wrapper from using a size or stride array it never declared.

Inductor's C++ wrapper declares each size/stride array once per writer and caches the variable's
name under the writer's `id()` (`CppWrapperCpu.codegen_int_array_var`). Some writers are buffers
made for one call site and then dropped; CPython gives a new one the dead one's address, so the
cache answers with a variable declared in the dead buffer, and the new buffer gets no declaration.
The wrapper then fails to compile, `'int_array_N' was not declared in this scope`, or not,
depending on where the allocator put the buffers (pytorch/pytorch#193621, open in torch 2.11 and
2.13). It failed one of two exports of the same staged decode program on the H200.

`writers_kept_alive()` keeps every writer the cache has seen alive for the compile, so no id is
reused and a cached name was always declared in the buffer asking for it. The key's other id, the
graph's, is left as it is: the writers' reuse is what failed.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def writers_kept_alive():
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.codegen_int_array_var

    def codegen_int_array_var(self, int_array, writeline, *args, **kwargs):
        self.__dict__.setdefault("_zerokv_int_array_writers", []).append(getattr(writeline, "__self__", writeline))
        return original(self, int_array, writeline, *args, **kwargs)

    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var
    try:
        yield
    finally:
        CppWrapperCpu.codegen_int_array_var = original
