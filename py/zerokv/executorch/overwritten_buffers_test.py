"""drop_overwritten_buffers: only state no step reads goes, and what the methods compute is unchanged."""

import torch
from executorch.exir import ExecutorchBackendConfig

from zerokv.executorch import hf_decoders as hf
from zerokv.executorch.api import _decomposed
from zerokv.executorch.overwritten_buffers import drop_overwritten_buffers

CONFIG = ExecutorchBackendConfig()


class Counter(torch.nn.Module):
    """transformers' cumulative_length pattern: set from an input, read, advanced."""

    def __init__(self):
        super().__init__()
        self.register_buffer("length", torch.tensor(0), persistent=False)

    def forward(self, x, start):
        self.length.copy_(start[0])
        positions = torch.arange(x.shape[1]) + self.length
        self.length.add_(x.shape[1])
        return x + positions


class Accumulator(torch.nn.Module):
    """Reads its buffer before it writes it: the value carries from step to step."""

    def __init__(self):
        super().__init__()
        self.register_buffer("length", torch.tensor(0))

    def forward(self, x, start):
        self.length.copy_(self.length + start[0])
        return x + self.length


class Broadcast(torch.nn.Module):
    """Overwrites a [4] buffer from a scalar: the copy's value is not its source's."""

    def __init__(self):
        super().__init__()
        self.register_buffer("length", torch.zeros(4, dtype=torch.long), persistent=False)

    def forward(self, x, start):
        self.length.copy_(start[0])
        return x + self.length.sum()


def _export(module):
    return _decomposed(torch.export.export(module, (torch.zeros(1, 3, dtype=torch.long), torch.tensor([2]))))


def _buffers(program):
    return [spec.target for spec in program.graph_signature.input_specs if spec.kind.name == "BUFFER"]


def test_a_buffer_overwritten_before_any_read_is_dropped():
    program = _export(Counter())
    assert drop_overwritten_buffers({"forward": program}, CONFIG) == {"forward": ["length"]}
    assert _buffers(program) == [] and "length" not in program.constants
    assert [spec.kind.name for spec in program.graph_signature.output_specs] == ["USER_OUTPUT"]
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(program.module()(x, torch.tensor([5])), x + torch.tensor([5, 6, 7]))


def test_state_a_step_reads_is_kept():
    for module in (Accumulator(), Broadcast()):
        program = _export(module)
        assert drop_overwritten_buffers({"forward": program}, CONFIG) == {}
        assert _buffers(program) == ["length"]


def test_a_buffer_another_method_reads_is_kept():
    programs = {"counter": _export(Counter()), "accumulator": _export(Accumulator())}
    assert drop_overwritten_buffers(programs, CONFIG) == {}
    assert _buffers(programs["counter"]) == ["length"]


def test_named_mutable_buffers_are_kept_for_the_host_to_read():
    program = _export(Counter())
    assert drop_overwritten_buffers({"forward": program}, ExecutorchBackendConfig(emit_mutable_buffer_names=True)) == {}
    assert _buffers(program) == ["length"]


def test_transformers_counters_go_and_every_step_computes_what_it_did():
    # Two exports of the same weights: each has caches of its own, so neither can make up for the other.
    exported = hf.export_prefill(hf.tiny_llama())
    program = _decomposed(hf.export_prefill(hf.tiny_llama()))
    assert drop_overwritten_buffers({"prefill": program}, CONFIG) == {
        "prefill": ["cumulative_length_0", "cumulative_length_1"]}
    assert not any(name.startswith("cumulative_length") for name in _buffers(program))
    # Consecutive steps of one method, each from the state the last left: the caches keep their
    # writes, and the logits are the same as the program's with its counters.
    before, after = exported.module(), program.module()
    for tokens, start in ((torch.tensor([[3, 1, 4, 1]]), 0), (torch.tensor([[5, 9]]), 4), (torch.tensor([[2, 6]]), 6)):
        positions = torch.arange(tokens.shape[1]) + start
        torch.testing.assert_close(after(input_ids=tokens, cache_position=positions),
                                   before(input_ids=tokens, cache_position=positions))
