"""What zerokv.kernels.dependent_launch relies on to give Inductor's kernels programmatic edges,
checked in this torch's Inductor: compiled with its PDL code (triton.enable_pdl), an Inductor kernel
launched right after a zerokv kernel waits before its first load or store, and every Inductor
kernel signals the kernel after it only after its wait, each branch of a combo kernel as well (with
the options compile_aoti compiles with); and kernel_sources_recorded sees every kernel Inductor
launches. Inductor writes PDL code only for sm_90 and later, so the test needs such a GPU. And this
torch's warning that it could not analyze a user kernel reaches kernel_analysis_failures
(compile_test checks the refusal under the CPU machine's torch)."""

import re

import pytest
import torch
import torch._higher_order_ops.triton_kernel_wrap as triton_kernel_wrap
from torch._inductor.utils import run_and_get_code

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("Inductor writes its PDL code for CUDA GPUs of sm_90 and later; this machine has none",
                allow_module_level=True)

from zerokv.aoti.compile import inductor_options  # noqa: E402
from zerokv.aoti.inductor_kernels import kernel_analysis_failures, kernel_sources_recorded  # noqa: E402
from zerokv.kernels import dependent_launch  # noqa: E402
from zerokv.kernels import matvec  # noqa: E402,F401  (registers the ops)
from zerokv.kernels.kernel_test_device import unanalyzable_kernel  # noqa: E402


def _step(x, residual, norm_weight, first, second):
    """A decoder's pattern: a product, the residual add and RMS norm after it (Inductor's reduction),
    a product of that, and pointwise work on both products' outputs."""
    hidden = residual + torch.ops.zerokv.matvec(x, first)
    variance = hidden.float().pow(2).mean(-1, keepdim=True)
    normed = norm_weight * (hidden.float() * torch.rsqrt(variance + 1e-5)).to(hidden.dtype)
    out = torch.ops.zerokv.matvec(normed, second)
    return hidden * torch.sigmoid(out[..., : hidden.shape[-1]]), out.sum(-1)


def _launches_and_sources(code):
    """([kernel names in launch order], {Inductor kernel name: its source})."""
    sources = dict(re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", code, re.S))
    call = code[code.index("def call("):]
    return re.findall(r"^\s*(\w+)\.run\(", call, re.M), sources


def _first(lines, *needles):
    return next((i for i, line in enumerate(lines) if any(needle in line for needle in needles)), None)


def _compiled(step, *args):
    """(step's results, its kernel names in launch order, {Inductor kernel: source} from its code,
    what kernel_sources_recorded saw), compiled with the options compile_aoti gives Inductor."""
    compiled = torch.compile(step, fullgraph=True,
                             options=inductor_options(torch.device("cuda"), coordinate_descent_tuning=False))
    with kernel_sources_recorded() as recorded:
        results, codes = run_and_get_code(compiled, *args)
    return (results, *_launches_and_sources("\n".join(codes)), recorded)


def _check_waits(launches, sources, recorded):
    """Every Inductor kernel (each branch of a combo kernel) signals only after its wait, and waits
    before its first access where a zerokv kernel comes before it; kernel_sources_recorded saw them
    all, and waiting_inductor_kernels names them all. Returns those after a zerokv kernel."""
    inductors = [name for name in launches if name in sources]
    assert inductors and len(inductors) < len(launches), f"launches {launches}: no Inductor or no zerokv kernel"
    after_zerokv = []
    for index, name in enumerate(launches):
        if name not in sources:
            # The wrapper calls a user kernel by its function's name and a number.
            assert re.sub(r"_\d+$", "", name) in dependent_launch.KERNELS, \
                f"{name} is neither Inductor's nor a zerokv kernel"
            continue
        assert name.startswith(dependent_launch.INDUCTOR_KINDS), name
        follows_zerokv = index and launches[index - 1] not in sources
        after_zerokv += [name] if follows_zerokv else []
        for lines in dependent_launch.branches(sources[name]):
            wait, signal = _first(lines, "gdc_wait"), _first(lines, "gdc_launch_dependents")
            access = _first(lines, "tl.load(", "tl.store(")
            assert wait is not None, f"{name} has a branch with no wait:\n{sources[name]}"
            assert signal is None or wait < signal, f"{name} signals before its wait:\n{sources[name]}"
            assert not follows_zerokv or access is None or wait < access, \
                f"{name}, after {launches[index - 1]}, accesses memory before its wait:\n{sources[name]}"
    assert set(dependent_launch.waiting_inductor_kernels(recorded)) == set(inductors), sorted(recorded)
    return after_zerokv


def test_inductor_kernels_wait_before_what_a_zerokv_kernel_before_them_writes():
    torch.manual_seed(0)
    hidden = 256
    args = (torch.randn(1, 1, 512, device="cuda", dtype=torch.bfloat16),
            torch.randn(1, 1, hidden, device="cuda", dtype=torch.bfloat16),
            torch.rand(hidden, device="cuda", dtype=torch.bfloat16),
            torch.randn(hidden, 512, device="cuda", dtype=torch.bfloat16),
            torch.randn(2 * hidden, hidden, device="cuda", dtype=torch.bfloat16))
    results, launches, sources, recorded = _compiled(_step, *args)
    for got, expected in zip(results, _step(*args)):
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
    assert _check_waits(launches, sources, recorded), f"launches {launches}: no Inductor kernel follows a zerokv kernel"


def _rotary_and_cache_writes(x, weight, cos, sin, k_cache, v_cache, position):
    """A decode step's attention inputs: the query's and key's rotary embeddings and the key's and
    value's cache writes, of three sizes, on one product's outputs."""
    q, k, v = torch.ops.zerokv.matvec(x, weight).split([256, 64, 64], dim=-1)

    def rotary(t):
        half = t.view(-1, 2, 16)
        return (t.view(-1, 32) * cos + torch.cat([-half[:, 1], half[:, 0]], -1) * sin).view(t.shape)

    k_cache.index_copy_(0, position, rotary(k).view(1, 64))
    v_cache.index_copy_(0, position, v.view(1, 64))
    return rotary(q)


def test_a_combo_kernel_after_a_zerokv_kernel_waits_in_each_branch_before_its_first_access():
    """compile_aoti's combo kernels: the independent kernels after a product are one launch, whose
    every branch waits for the product before it touches memory."""
    torch.manual_seed(0)
    args = (torch.randn(1, 1, 512, device="cuda", dtype=torch.bfloat16),
            torch.randn(384, 512, device="cuda", dtype=torch.bfloat16),
            torch.randn(32, device="cuda", dtype=torch.bfloat16),
            torch.randn(32, device="cuda", dtype=torch.bfloat16))
    caches = [torch.zeros(8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    position = torch.tensor([5], device="cuda")
    q, launches, sources, recorded = _compiled(_rotary_and_cache_writes, *args, *caches[:2], position)
    expected = _rotary_and_cache_writes(*args, *caches[2:], position)
    torch.testing.assert_close(q, expected, atol=0.1, rtol=0.05)
    torch.testing.assert_close(caches[:2], caches[2:], atol=0.1, rtol=0.05)
    after_zerokv = _check_waits(launches, sources, recorded)
    combos = [name for name in after_zerokv if len(dependent_launch.branches(sources[name])) > 1]
    assert combos, f"launches {launches}: no combo kernel after the product:\n" + \
        "\n".join(sources[name] for name in after_zerokv)


def test_this_torchs_failed_analysis_of_a_user_kernel_is_collected():
    # torch 2.11 (the GPU machine's) names the analysis identify_mutated_tensors; later ones
    # identify_accessed_tensors.
    analysis = getattr(triton_kernel_wrap, "identify_accessed_tensors", None) or \
        triton_kernel_wrap.identify_mutated_tensors
    with kernel_analysis_failures() as failures:
        analysis(unanalyzable_kernel, {"X": torch.empty(4, device="cuda"), "N": 4}, {})
    assert len(failures) == 1, f"torch {torch.__version__} warned through another logger: {failures}"
    assert "def unanalyzable_kernel(X, N: tl.constexpr):" in failures[0] and "no attribute 'to'" in failures[0], failures
