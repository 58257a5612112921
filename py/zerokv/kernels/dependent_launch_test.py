"""Which of Inductor's kernels a package names as ones that may launch early."""

import torch

from zerokv.kernels import dependent_launch

# The shapes of Inductor's kernels, as it writes them with its PDL code (triton.enable_pdl).
WAITS_THEN_SIGNALS = """@triton.jit
def {name}(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    tl.extra.cuda.gdc_wait()
    tmp0 = tl.load(in_ptr0 + xoffset)
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr0 + xoffset, tmp0)
"""
SIGNALS_FIRST = """@triton.jit
def {name}(in_ptr0, out_ptr0):
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    tl.store(out_ptr0, tl.load(in_ptr0))
"""
NO_WAIT = """@triton.jit
def {name}(out_ptr0):
    tl.store(out_ptr0, 0.0)
"""

# A combo kernel of two (Inductor's combo_kernels), each branch as the shapes above write it.
COMBO = """@triton.jit
def {{name}}(in_ptr0, in_ptr1, out_ptr0, out_ptr1, xnumel_0, xnumel_1, XBLOCK : tl.constexpr):
    pid = tl.program_id(0)
    num_xblocks_0 = tl.cdiv(xnumel_0, XBLOCK)
    num_xblocks_1 = num_xblocks_0 + tl.cdiv(xnumel_1, XBLOCK)
    if pid < num_xblocks_0:
        pid_offset = pid
        xoffset = pid_offset * XBLOCK
{first}
    elif pid < num_xblocks_1:
        pid_offset = pid - num_xblocks_0
        xoffset = pid_offset * XBLOCK
{second}
    else:
        pass
"""
BRANCH_WAITS_THEN_SIGNALS = """        tl.extra.cuda.gdc_wait()
        tmp0 = tl.load(in_ptr0 + xoffset)
        tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr0 + xoffset, tmp0)"""
BRANCH_SIGNALS_FIRST = """        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        tl.store(out_ptr1 + xoffset, tl.load(in_ptr1 + xoffset))"""
BRANCH_NO_WAIT = """        tl.store(out_ptr1 + xoffset, 0.0)"""


def _sources(**shapes):
    return {name: shape.format(name=name) for name, shape in shapes.items()}


def test_only_pointwise_and_reduction_kernels_that_wait_before_they_signal_are_named():
    sources = _sources(triton_poi_fused_add_0=WAITS_THEN_SIGNALS, triton_red_fused_mean_1=WAITS_THEN_SIGNALS,
                       triton_per_fused_sum_2=WAITS_THEN_SIGNALS, triton_poi_fused_cat_3=SIGNALS_FIRST,
                       triton_poi_fused_zeros_4=NO_WAIT, triton_tem_fused_mm_5=WAITS_THEN_SIGNALS)
    assert dependent_launch.waiting_inductor_kernels(sources) == (
        "triton_per_fused_sum_2", "triton_poi_fused_add_0", "triton_red_fused_mean_1")


def test_a_kernel_that_only_waits_is_named():
    sources = {"triton_poi_fused_copy_0": WAITS_THEN_SIGNALS.format(name="triton_poi_fused_copy_0").replace(
        "    tl.extra.cuda.gdc_launch_dependents()\n", "")}
    assert dependent_launch.waiting_inductor_kernels(sources) == ("triton_poi_fused_copy_0",)


def test_a_package_for_an_older_device_names_no_kernel():
    sources = _sources(triton_poi_fused_add_0=WAITS_THEN_SIGNALS)
    assert dependent_launch.early_kernels(torch.device("cpu"), sources) == ()


def test_a_combo_kernel_is_named_only_if_every_branch_that_signals_waits_first():
    """Each branch of a combo kernel waits and signals on its own: one that signals before its own
    wait lets the kernel after launch before the kernel before has ended, whatever another branch
    does first."""
    combos = {
        "triton_poi_fused_0": (BRANCH_WAITS_THEN_SIGNALS, BRANCH_WAITS_THEN_SIGNALS),
        "triton_poi_fused_1": (BRANCH_WAITS_THEN_SIGNALS, BRANCH_SIGNALS_FIRST),
        "triton_poi_fused_2": (BRANCH_WAITS_THEN_SIGNALS, BRANCH_NO_WAIT),
        "triton_poi_fused_3": (BRANCH_NO_WAIT, BRANCH_NO_WAIT),
    }
    sources = {name: COMBO.format(first=first, second=second).format(name=name)
               for name, (first, second) in combos.items()}
    assert dependent_launch.waiting_inductor_kernels(sources) == ("triton_poi_fused_0", "triton_poi_fused_2")


def test_a_combo_kernels_branches_each_start_with_the_lines_before_the_first():
    source = COMBO.format(first=BRANCH_WAITS_THEN_SIGNALS, second=BRANCH_NO_WAIT).format(name="triton_poi_fused_0")
    first, second = dependent_launch.branches(source)
    assert first[2].strip() == second[2].strip() == "pid = tl.program_id(0)"
    assert first[5].strip() == "if pid < num_xblocks_0:" and "gdc_wait" in first[8]
    assert second[5].strip() == "elif pid < num_xblocks_1:" and second[8].strip() == "tl.store(out_ptr1 + xoffset, 0.0)"
    assert dependent_launch.branches(WAITS_THEN_SIGNALS) == [WAITS_THEN_SIGNALS.splitlines()]
