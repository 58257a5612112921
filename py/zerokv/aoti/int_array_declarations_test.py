"""A size array asked for by a fresh writer is declared in that writer, even where the writer before
it was dropped and its address reused (pytorch/pytorch#193621)."""

from itertools import count

from torch._inductor.codegen.common import IndentedBuffer
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch.utils._ordered_set import OrderedSet

from zerokv.aoti.int_array_declarations import writers_kept_alive


def _wrapper():
    """The wrapper's int-array state alone: what codegen_int_array_var reads."""
    wrapper = CppWrapperCpu.__new__(CppWrapperCpu)
    wrapper.int_array_id = count()
    wrapper.declared_int_array_vars = OrderedSet()
    wrapper.codegen_int_array_var_cache = {}
    return wrapper


def _undeclared(wrapper, call_sites=50):
    """The call sites whose own writer did not get the array it uses, each writer dropped after."""
    undeclared = []
    for site in range(call_sites):
        writer = IndentedBuffer()
        name = wrapper.codegen_int_array_var("{1, 2, 3}", writer.writeline)
        if f"{name}[]" not in writer.getvalue():
            undeclared.append(site)
        del writer
    return undeclared


def test_every_writer_declares_what_it_uses():
    with writers_kept_alive():
        assert _undeclared(_wrapper()) == []


def test_the_upstream_cache_is_still_what_this_works_around():
    """Fails once torch fixes the cache: then the workaround can go."""
    assert _undeclared(_wrapper()) != []


def test_the_patch_is_undone():
    original = CppWrapperCpu.codegen_int_array_var
    with writers_kept_alive():
        assert CppWrapperCpu.codegen_int_array_var is not original
    assert CppWrapperCpu.codegen_int_array_var is original
