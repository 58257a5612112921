"""Starting weights on their way into L2 while the step's memory would otherwise idle, in zerokv's
Triton kernels (zerokv.kernels.weight_prefetch says which and when).

`prefetch_to_l2(Tensor, share, after)` has the program's first thread issue one bulk prefetch
(cp.async.bulk.prefetch.L2, sm_90 and later) of bytes [program * share, (program + 1) * share) of
`Tensor`, and returns 0.0 once `after` is computed. A prefetch is a hint: it moves no value anywhere
a kernel reads, and the copy engine finishes it after the program has ended. An address that is not
16-byte aligned, or a share of 0, issues nothing (the instruction requires both).

The kernel adds the 0.0 to a value it stores, which holds the prefetch after what `after` is
computed from; added to an address instead, Inductor's analysis of which arguments a user kernel
writes would follow it back to `Tensor` and take that for written, and AOTInductor would copy the
weights before every launch (zerokv.kernels.grid_dependency).
"""

import triton
import triton.language as tl

# One statement list: Inductor copies the source into a string literal (zerokv.kernels.grid_dependency).
_BULK_PREFETCH = tl.constexpr("{ .reg .pred issue; .reg .u32 thread; .reg .b64 misaligned; mov.u32 thread, %tid.x; "
                  "and.b64 misaligned, $1, 15; setp.eq.u32 issue, thread, 0; setp.eq.and.u64 issue, misaligned, 0, "
                  "issue; setp.ne.and.u32 issue, $2, 0, issue; @issue cp.async.bulk.prefetch.L2.global [$1], $2; "
                  "mov.u32 $0, 0; }")
# Prefetches are issued in one program's share of at most this many bytes (the launch spreads a
# tensor's bytes over its programs); the instruction takes a 32-bit size.
MAX_SHARE = 1 << 30


@triton.jit
def prefetch_to_l2(Tensor, share, after):
    start = Tensor.to(tl.int64, bitcast=True) + tl.program_id(0).to(tl.int64) * share
    # `share` may arrive as a Python integer (torch 2.11's analysis of the kernel compiles it so).
    size = tl.zeros([], tl.int32) + share
    zero = tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l,r,f", [start, size, after], dtype=tl.int32, is_pure=True,
                                     pack=1)
    return zero.to(tl.float32)
