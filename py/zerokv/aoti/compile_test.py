"""compile_aoti's binding table, metadata and options (one small AOTInductor compile; the engines'
are the runtime's build outputs, //py/zerokv/aoti:decode_blobs, exercised by
//cc/runtime:backend_aoti_test)."""

import io
import json
import zipfile

import pytest
import torch

from zerokv import blob
from zerokv.aoti.compile import binding_table, _export, package_metadata
from zerokv.kernels import dependent_launch


class MutatingStep(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        k_cache.index_copy_(2, pos, x)
        return (k_cache * 2).sum(2)


class BufferStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 2, 8, 4))

    def forward(self, x, pos):
        self.k_cache.index_copy_(2, pos, x)
        return self.k_cache.sum(2)


def _inputs():
    return (torch.ones(1, 2, 1, 4), torch.tensor([3]), torch.zeros(1, 2, 8, 4))


def _table(module, inputs, device=blob.Device.CUDA):
    return binding_table(_export(module, inputs, None), device)


def test_a_mutated_input_is_an_aliased_output_binding():
    bindings, aliased_io = _table(MutatingStep(), _inputs())
    assert [(b.name, b.direction) for b in bindings] == [
        ("x", blob.Direction.INPUT),
        ("pos", blob.Direction.INPUT),
        ("k_cache", blob.Direction.INPUT),
        ("k_cache_out", blob.Direction.OUTPUT),
        ("sum_1", blob.Direction.OUTPUT),
    ]
    assert aliased_io == [blob.AliasedIO("k_cache_out", "k_cache", blob.AliasKind.KV_CACHE_UPDATE)]
    assert bindings[3].shape == bindings[2].shape == [blob.Dim(n, n) for n in (1, 2, 8, 4)]
    assert bindings[1].dtype == blob.DType.INT64
    assert all(b.device == blob.Device.CUDA for b in bindings)


def test_an_engine_owned_buffer_mutation_is_refused():
    with pytest.raises(ValueError, match="mutates buffer 'k_cache'"):
        _table(BufferStep(), _inputs()[:2])


class Handed(Exception):
    """Stops compile_aoti at AOTInductor's door, with the module it was handed."""


def test_aotinductor_is_handed_the_matvec_calls_of_one_input_as_one_launch_of_constant_weights(monkeypatch):
    from zerokv.aoti.compile import compile_aoti
    from zerokv.kernels import matvec  # noqa: F401  (registers the ops the step calls)

    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(4, 16))

        def forward(self, x):
            return torch.ops.zerokv.matvec(x, self.query), torch.ops.zerokv.matvec(x, self.key)

    def handed(module, *args, **kwargs):
        raise Handed({str(node.target): node.kwargs.get("constant_weights")
                      for node in module.graph.nodes if node.op == "call_function"})

    monkeypatch.setattr(torch._inductor, "aot_compile", handed)
    with pytest.raises(Handed) as caught:
        compile_aoti(_export(Projections(), (torch.randn(1, 1, 16),), None), [torch.randn(1, 1, 16)], "cpu")
    calls = caught.value.args[0]
    assert "zerokv.matvec.default" not in calls
    assert calls["zerokv.matvec_siblings.default"] is True  # the module's parameters: no kernel writes them


def test_a_kernel_inductor_cannot_analyze_is_refused_by_name(monkeypatch):
    """Inductor takes every argument of a user kernel it cannot analyze for written, and AOTInductor
    copies each before every launch: correct, and on the H200 1.3 to 2.5 times slower."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    from zerokv.aoti.compile import AotiCompileError, compile_aoti
    from zerokv.kernels.kernel_test_device import an_h200_for_triton, unanalyzable_kernel

    def analyzing(module, args, kwargs, options):
        with an_h200_for_triton():
            identify_accessed_tensors(unanalyzable_kernel, {"X": torch.empty(4), "N": 4}, {})
        return []

    monkeypatch.setattr(torch._inductor, "aot_compile", analyzing)
    with pytest.raises(AotiCompileError, match=r"Inductor could not tell which arguments a Triton kernel writes "
                                               r"\(at 2:\d+; def unanalyzable_kernel\(X, N: tl.constexpr\):; "
                                               r"AttributeError\(.*no attribute 'to'.*\)\), so AOTInductor would copy"):
        compile_aoti(MutatingStep(), _inputs(), "cpu")


def test_a_package_names_the_kernels_that_may_launch_early_where_they_were_compiled_to():
    bindings, aliased_io = _table(MutatingStep(), _inputs())
    early = dependent_launch.KERNELS + ("triton_poi_fused_add_0",)
    cuda = package_metadata(bindings, aliased_io, torch.device("cuda"), True, early)
    assert cuda["zerokv.dependent_launch_kernels"].split(",") == list(early)
    assert cuda["zerokv.aliases"] == "k_cache_out=k_cache" and cuda["zerokv.cuda_graph"] == "1"
    cpu = package_metadata(bindings, aliased_io, torch.device("cpu"), False, ())
    assert cpu["zerokv.dependent_launch_kernels"] == "" and cpu["zerokv.device"] == "cpu"
    assert not dependent_launch.supported(torch.device("cpu"))


@pytest.mark.parametrize("supported", [True, False])
def test_inductors_kernels_have_its_pdl_code_where_they_may_launch_early(monkeypatch, supported):
    """Inductor's kernels (the norms, the rotary embedding) get programmatic edges only compiled with
    its waits (zerokv.kernels.dependent_launch)."""
    from zerokv.aoti.compile import compile_aoti

    def handed(module, args, kwargs, options):
        raise Handed(options)

    monkeypatch.setattr(torch._inductor, "aot_compile", handed)
    monkeypatch.setattr(dependent_launch, "supported", lambda device: supported)
    with pytest.raises(Handed) as caught:
        compile_aoti(MutatingStep(), _inputs(), "cpu")
    assert caught.value.args[0]["triton.enable_pdl"] is supported
    assert isinstance(torch._inductor.config.triton.enable_pdl, bool)  # an option of this torch's Inductor


@pytest.mark.parametrize("device, combined", [("cuda", True), ("cpu", False)])
def test_a_cuda_package_combines_independent_kernels_into_one_launch(monkeypatch, device, combined):
    """Inductor's combo kernels, for the Triton kernels of CUDA packages (a decoder's rotary embeddings
    and cache writes, one launch a layer)."""
    from zerokv.aoti.compile import inductor_options

    monkeypatch.setattr(dependent_launch, "supported", lambda device: False)  # asks the device otherwise
    options = inductor_options(torch.device(device), coordinate_descent_tuning=False)
    assert options["combo_kernels"] is combined
    for name, value in options.items():  # each an option of this torch's Inductor, of the type it takes
        section, _, key = name.rpartition(".")
        config = getattr(torch._inductor.config, section) if section else torch._inductor.config
        assert isinstance(getattr(config, key), type(value)), name


def test_kernels_named_while_aotinductor_compiles_are_in_the_metadata_it_writes(monkeypatch):
    """compile_aoti names Inductor's kernels in the package's metadata as Inductor defines them,
    before AOTInductor writes that metadata from its configuration; nothing outlives the compile.
    (Inductor defines Triton kernels for CUDA only: here its C++ wrapper's code generation, which
    runs after every kernel is defined, names one instead.)"""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    from zerokv.aoti.compile import EARLY_KERNELS_KEY, _name_early_kernels

    waits = "def triton_poi_fused_add_0(in_ptr0):\n    tl.extra.cuda.gdc_wait()\n    tl.load(in_ptr0)\n"
    generate = CppWrapperCpu.generate

    def generate_naming(self, *args, **kwargs):
        _name_early_kernels(torch.device("cpu"), {"triton_poi_fused_add_0": waits})
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(dependent_launch, "supported", lambda device: True)
    monkeypatch.setattr(CppWrapperCpu, "generate", generate_naming)
    files = torch._inductor.aot_compile(
        torch.export.export(MutatingStep(), _inputs()).module(), _inputs(),
        options={"aot_inductor.package": True, "aot_inductor.metadata": {EARLY_KERNELS_KEY: "", "zerokv.device": "cpu"}})
    written = [json.loads(open(f).read()) for f in files if isinstance(f, str) and f.endswith("_metadata.json")]
    assert written and all(m[EARLY_KERNELS_KEY] == ",".join(dependent_launch.KERNELS + ("triton_poi_fused_add_0",))
                           and m["zerokv.device"] == "cpu" for m in written)
    assert torch._inductor.config.aot_inductor.metadata == {}


def test_no_other_compile_can_rewrite_the_files_a_compile_packages(monkeypatch, tmp_path):
    """Compiles of one program in parallel (a test's shards on the GPU machine) shared the files
    AOTInductor writes into Inductor's cache: one packaged a metadata file that another was
    rewriting, and was refused. Here every metadata file in Inductor's cache is emptied just before
    the package is made, as such a compile would."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from zerokv.aoti import compile as aoti_compile

    package = aoti_compile.package_aoti

    def package_after_another_compile(path, files):
        for written in (tmp_path / "inductor").rglob("*_metadata.json"):
            written.write_text("")
        return package(path, files)

    monkeypatch.setattr(aoti_compile, "package_aoti", package_after_another_compile)
    with temporary_cache_dir(str(tmp_path / "inductor")):
        build = aoti_compile.compile_aoti(MutatingStep(), _inputs(), "cpu")
    with zipfile.ZipFile(io.BytesIO(build.payload)) as packaged:
        assert any(name.endswith("_metadata.json") for name in packaged.namelist())


def _package(**files):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as package:
        for name, text in files.items():
            package.writestr(f"engine/data/aotinductor/model/{name}", text)
    return buffer.getvalue()


def test_a_package_holding_another_compiles_metadata_is_refused_by_name():
    from zerokv.aoti.compile import EARLY_KERNELS_KEY, AotiCompileError, check_packaged_metadata

    ours = {"zerokv.bindings": "x:INPUT:FLOAT32", "zerokv.dependent_launch_kernels": "_matvec_kernel"}
    check_packaged_metadata(_package(**{"w_metadata.json": json.dumps({**ours, "AOTI_DEVICE_KEY": "cuda"}), "w.so": ""}), ours)
    # Fewer kernels named early is slower, not wrong; one this compile did not name is refused.
    check_packaged_metadata(_package(**{"w_metadata.json": json.dumps({**ours, EARLY_KERNELS_KEY: ""})}), ours)
    with pytest.raises(AotiCompileError, match=r"\(zerokv.dependent_launch_kernels differ\)"):
        check_packaged_metadata(_package(**{"w_metadata.json": json.dumps(
            {**ours, EARLY_KERNELS_KEY: "_matvec_kernel,triton_poi_fused_zeros_0"})}), ours)
    # As the H200 saw it: what another compile wrote (no binding table), and two documents in one file.
    theirs = json.dumps({"AOTI_DEVICE_KEY": "cuda"})
    with pytest.raises(AotiCompileError, match=r"w_metadata.json is not this compile's metadata \(zerokv.bindings, "
                                               r"zerokv.dependent_launch_kernels differ\)"):
        check_packaged_metadata(_package(**{"w_metadata.json": theirs}), ours)
    with pytest.raises(AotiCompileError, match="k_metadata.json is not this compile's metadata.*Extra data"):
        check_packaged_metadata(_package(**{"k_metadata.json": json.dumps(ours) + theirs}), ours)
    with pytest.raises(AotiCompileError, match="no metadata file"):
        check_packaged_metadata(_package(**{"w.so": ""}), ours)
