"""zerokv.executorch.export on Hugging Face-exported decoders (transformers' ExecuTorch integration,
random weights): the caller's program is left as it was, and caches the methods cannot share are
refused rather than silently duplicated."""

import pytest
import torch

import zerokv.executorch as zx
from zerokv import blob
from zerokv.executorch import hf_decoders as hf
from zerokv.executorch.delegates import sole_delegate_blob

CPU = {"compile_device": "cpu"}


def _snapshot(program):
    return (dict(program.constants), dict(program.state_dict), program.graph_module.code, str(program.graph_signature))


def test_export_leaves_the_callers_program_intact_and_exports_it_again():
    model = hf.tiny_llama()
    program = hf.export_decode(model)
    before = _snapshot(program)
    inputs = {"input_ids": torch.tensor([[3]]), "cache_position": torch.tensor([0])}
    expected = program.module()(**inputs)

    manager = zx.export({"decode": program}, engine="aoti", engine_options=CPU)
    assert blob.parse(sole_delegate_blob(manager.exported_program("decode").graph_module)).metadata.bindings
    constants, state_dict, code, signature = _snapshot(program)
    assert constants.keys() == before[0].keys()
    assert all(constants[name] is value for name, value in before[0].items())
    assert all(state_dict[name] is value for name, value in before[1].items())
    assert (code, signature) == before[2:]

    staged = zx.export({"decode": program}, engine="aoti", engine_options=CPU, zero_copy_kv=False)
    assert staged.methods == {"decode"}
    torch.testing.assert_close(program.module()(**inputs), expected)


@pytest.mark.parametrize("zero_copy_kv", [True, False])
def test_buffer_caches_written_by_one_method_and_used_by_another_are_refused(zero_copy_kv):
    model = hf.tiny_llama()
    programs = {"prefill": hf.export_prefill(model), "decode": hf.export_decode(model)}
    shared = r"buffers \[.*'key_cache_0'.*\] are written by method 'prefill' and used by \['decode'\].*runtime_kv"
    with pytest.raises(zx.ZeroCopyError, match=shared):
        zx.export(programs, engine="aoti", engine_options=CPU, zero_copy_kv=zero_copy_kv)


@pytest.mark.parametrize("constant_methods, message", [
    ({"decode": 1}, r"constant_methods \['decode'\] are also methods of the program"),
    ([("get_max_seq_len", 32)], "constant_methods: expected {method name: value}"),
])
def test_bad_constant_methods_are_refused_before_anything_is_built(constant_methods, message):
    with pytest.raises(zx.ZeroKVError, match=message):
        zx.export({"decode": hf.export_decode(hf.tiny_llama())}, engine="aoti", engine_options=CPU,
                  constant_methods=constant_methods)
