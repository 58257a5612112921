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
