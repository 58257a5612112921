"""Declares each size or stride array of AOTInductor's C++ wrapper where it is used.

Inductor's C++ wrapper declares a size/stride array once and caches the variable's name under the
array, the writer's `id()` and the graph's (`CppWrapperCpu.codegen_int_array_var`); the cache can
answer with a variable that is not declared where it is used, and the wrapper fails to compile,
`'int_array_N' was not declared in this scope`, or not, depending on where the allocator put things:
- a writer made for one call site and dropped: CPython gives a new one the dead one's address
  (pytorch/pytorch#193621, open in torch 2.11 and 2.13). It failed one of two exports of the same
  staged decode program on the H200.
- with every writer kept alive for the compile (the first workaround here), the 1B decode step's
  static export still failed on the H200, at a buffer's reuse: a variable declared in the same
  writer, out of scope there (in a block that had closed, or a pass whose lines were dropped).

`declarations_where_used()` bypasses the cache for the compile: each call declares a variable of
its own through the writer it is given, just before the line that uses it. The wrapper gets more
declarations, each in scope.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def declarations_where_used():
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.codegen_int_array_var

    def codegen_int_array_var(self, int_array, writeline, known_statically=False, graph=None):
        return self._codegen_int_array_var_impl(int_array, writeline, known_statically)

    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var
    try:
        yield
    finally:
        CppWrapperCpu.codegen_int_array_var = original
