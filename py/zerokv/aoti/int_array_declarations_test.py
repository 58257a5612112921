"""A size array is declared in the writer that asks for it, in the block it is used in: where the
writer before it was dropped and its address reused (pytorch/pytorch#193621), and where the array
was declared before in a block that has closed."""

from itertools import count

from torch._inductor.codegen.common import IndentedBuffer
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch.utils._ordered_set import OrderedSet

from zerokv.aoti.int_array_declarations import declarations_where_used

ARRAY = "{1, 2, 3}"


def _wrapper():
    """The wrapper's int-array state alone: what codegen_int_array_var reads."""
    wrapper = CppWrapperCpu.__new__(CppWrapperCpu)
    wrapper.int_array_id = count()
    wrapper.declared_int_array_vars = OrderedSet()
    wrapper.codegen_int_array_var_cache = {}
    return wrapper


def _undeclared_in_dropped_writers(wrapper, call_sites=50):
    """The call sites whose own writer did not get the array it uses, each writer dropped after."""
    undeclared = []
    for site in range(call_sites):
        writer = IndentedBuffer()
        name = wrapper.codegen_int_array_var(ARRAY, writer.writeline)
        if f"{name}[]" not in writer.getvalue():
            undeclared.append(site)
        del writer
    return undeclared


def _declared_after_the_block(wrapper):
    """Whether an array used after a block, and used inside it before, is declared after it."""
    writer = IndentedBuffer()
    writer.writeline("{")
    with writer.indent():
        writer.writeline(f"use({wrapper.codegen_int_array_var(ARRAY, writer.writeline)});")
    writer.writeline("}")
    after = writer.getvalue().count("\n")
    name = wrapper.codegen_int_array_var(ARRAY, writer.writeline)
    return f"{name}[]" in "\n".join(writer.getvalue().splitlines()[after:])


def test_every_writer_declares_what_it_uses():
    with declarations_where_used():
        assert _undeclared_in_dropped_writers(_wrapper()) == []


def test_an_array_used_after_a_block_is_declared_after_it():
    with declarations_where_used():
        assert _declared_after_the_block(_wrapper())


def test_the_upstream_cache_is_still_what_this_works_around():
    """Fails once torch fixes the cache: then the workaround can go."""
    assert _undeclared_in_dropped_writers(_wrapper()) != []
    assert not _declared_after_the_block(_wrapper())


def test_the_patch_is_undone():
    original = CppWrapperCpu.codegen_int_array_var
    with declarations_where_used():
        assert CppWrapperCpu.codegen_int_array_var is not original
    assert CppWrapperCpu.codegen_int_array_var is original
