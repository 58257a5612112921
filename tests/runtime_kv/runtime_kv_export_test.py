"""What export refuses about the runtime's positions: an input the runtime fills that is no integer
method input, a ring whose model computes its own write slots, and a positions input that something
outside the delegate owning the caches reads (it would see the caller's values, not the runtime's).
Each refusal names the input and the method."""

import pytest
import torch
from torch.export.graph_signature import InputKind

import zerokv.executorch as zx
from tests.runtime_kv import make_program as spec
from zerokv.executorch import runtime_kv, runtime_kv_models as models


def _export(programs, runtime_kv):
    return zx.export(programs, engine="aoti", engine_options={"compile_device": "cpu"}, runtime_kv=runtime_kv)


def _flat(positions="position"):
    layer = zx.KVCacheLayer("k_cache", "v_cache", max_capacity=spec.MAX_CAPACITY, initial_capacity=spec.INITIAL_CAPACITY)
    return zx.RuntimeKV(layers=(layer,), step_width=("tokens", 1), positions=positions)


def test_a_ring_layer_names_its_slots_input_and_a_flat_one_none():
    with pytest.raises(zx.RuntimeKVError, match="a ring cache needs `slots`"):
        zx.KVCacheLayer("k", "v", max_capacity=8, initial_capacity=8, policy="ring", window=8)
    with pytest.raises(zx.RuntimeKVError, match="is for ring caches"):
        zx.KVCacheLayer("k", "v", max_capacity=8, slots="slots")


def test_the_positions_input_must_be_an_integer_input_of_the_method():
    program = models.export_step(models.CacheInputDecoder(seed=0), 1, spec.MAX_CAPACITY)
    with pytest.raises(zx.RuntimeKVError, match="method 'decode': positions input 'nope' is not an input"):
        _export({"decode": program}, _flat("nope"))
    with pytest.raises(zx.RuntimeKVError, match="positions input 'k_cache' is torch.float32"):
        _export({"decode": program}, _flat("k_cache"))


class _RingComputingItsOwnSlot(spec.RingDecoder):
    """Ignores `slots` and writes at position mod WINDOW itself: the modulo is the runtime's job."""

    def forward(self, tokens, position, slots, k_cache, v_cache):
        own = (torch.arange(1) + position) % spec.WINDOW
        return super().forward(tokens, position, own + 0 * slots, k_cache, v_cache)


def test_a_ring_whose_model_computes_its_own_slot_is_refused():
    program = spec.export_ring_step(_RingComputingItsOwnSlot(seed=0))
    with pytest.raises(zx.RuntimeKVError, match="ring cache 'k_cache' is not written at its slots input 'slots'"):
        _export({"decode": program}, spec.ring_runtime_kv())


class _ReturnsItsPosition(models.CacheInputDecoder):
    """Hands the position back to the caller: a reader outside the delegate."""

    def forward(self, tokens, position, k_cache, v_cache):
        return super().forward(tokens, position, k_cache, v_cache), position


def test_a_positions_input_read_outside_the_owning_delegate_is_refused():
    capacity = torch.export.Dim("capacity", min=2, max=spec.MAX_CAPACITY)
    k_cache, v_cache = models.empty_caches(spec.MAX_CAPACITY)
    with torch.no_grad():
        program = torch.export.export(
            _ReturnsItsPosition(seed=0).eval(), (torch.zeros(1, 1, dtype=torch.long), torch.tensor(0), k_cache, v_cache),
            dynamic_shapes=(None, None, {2: capacity}, {2: capacity}))
    with pytest.raises(zx.RuntimeKVError,
                       match="method 'decode': the positions input 'position' is read outside the zerokv delegate"):
        _export({"decode": program}, _flat())


class _RingFirst(torch.nn.Module):
    """A delegate's program whose first user input is a cache, and whose two caches differ in extent."""

    def forward(self, ring, tokens, flat):
        return ring[:, :, :1] + flat[:, :, -1:] + tokens


def test_bound_caches_keep_their_specs_order_when_the_first_user_input_is_one():
    # ExecuTorch unlifts buffers by position (input specs against placeholders): a cache bound
    # out of order would run a program's shape propagation with another cache's extent.
    caches = (torch.zeros(1, 2, 11, 4), torch.zeros(1, 2, 128, 4))
    program = torch.export.export(_RingFirst(), (caches[0], torch.zeros(1, 2, 1, 4), caches[1]),
                                  dynamic_shapes=({2: torch.export.Dim("ring", min=2, max=11)}, None,
                                                  {2: torch.export.Dim("capacity", min=2, max=128)}))
    runtime_kv._bind_inside(program, [0, 2])
    placeholders = list(program.graph.find_nodes(op="placeholder"))
    assert [node.name for node in placeholders] == [spec.arg.name for spec in program.graph_signature.input_specs]
    assert [program.state_dict[spec.target].shape[2] for spec in program.graph_signature.input_specs
            if spec.kind == InputKind.BUFFER] == [11, 128]
