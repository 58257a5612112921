"""The wait for the kernel before, in zerokv's Triton kernels (zerokv.kernels.dependent_launch).

`wait_for_the_kernel_before()` signals that the next kernel may launch
(griddepcontrol.launch_dependents), waits until the kernel before has completed with its writes
visible (griddepcontrol.wait), and returns 0. A kernel adds that 0 to the address of everything the
kernel before may have written, so that no load of it can be issued before the wait: the order is
held by the data. Triton's own gdc_wait is an impure inline assembly, held in place as a side
effect, and Inductor's analysis of which arguments a user kernel writes cannot read one: it then
takes every tensor argument as written, and AOTInductor copies each (the weights included) before
every launch, which on the H200 made the 1B decode step 2.5 times slower. This one is pure.
Without a programmatic launch both instructions do nothing.
"""

import triton
import triton.language as tl


@triton.jit
def wait_for_the_kernel_before():
    # One line: Inductor copies this source into a string literal, where an escaped newline breaks it.
    zero = tl.inline_asm_elementwise("griddepcontrol.launch_dependents; griddepcontrol.wait; mov.u32 $0, 0;",
                                     "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    # Declared a multiple of 16, so that an address it is added to keeps its alignment and the
    # loads from it stay vector loads.
    return tl.multiple_of(zero, 16)
