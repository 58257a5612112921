"""zerokv::flash_decode against SDPA over the committed positions. Under Triton's interpreter
(TRITON_INTERPRET=1, as the Bazel target sets it) the kernels run on the CPU in float16 (the
interpreter's bfloat16 tl.dot is wrong), which checks the chunking, masking and combine; without it,
on a CUDA machine, they run compiled in bfloat16 and float16. That the kernels compile for the GPU is
compile_test's."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
if not (INTERPRET or CUDA):
    pytest.skip("no CUDA device: run under Triton's interpreter, TRITON_INTERPRET=1", allow_module_level=True)

from zerokv.kernels import flash_decode as fd  # noqa: E402  (Triton: the venv pins it)
from zerokv.kernels.flash_decode_contract import FlashDecodeError  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
# Triton 3.6's interpreter converts a pipelined loop's loaded bound with int(), which NumPy deprecates
# (triton-lang/triton#9171; the venv keeps NumPy below 2.4, where it became an error).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float16]


def _reference(query, key, value, position, scale):
    committed = min(position + 1, key.shape[2])
    group = query.shape[1] // key.shape[1]
    key = key[:, :, :committed].float().repeat_interleave(group, 1)
    value = value[:, :, :committed].float().repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query.float(), key, value, scale=scale)
    return out.transpose(1, 2)


def _inputs(batch, query_heads, kv_heads, capacity, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, query_heads, 1, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator)
    return [tensor.to(DEVICE, dtype) for tensor in (query, key, value)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stages", [1, 3])  # the while loop, and the pipelined one
@pytest.mark.parametrize("batch, query_heads, kv_heads, capacity, head_dim, position, splits", [
    (1, 8, 2, 300, 16, 0, 4),        # one position: every split but the first is empty
    (1, 8, 2, 300, 16, 150, 4),      # the last chunk partly filled
    (1, 8, 2, 300, 16, 299, 4),      # the whole capacity
    (2, 4, 4, 200, 32, 130, 8),      # two sequences, no grouping, more splits than tiles
    (2, 8, 2, 200, 16, 120, 4),      # two sequences of grouped heads: the combine finds each row
    (1, 32, 8, 1000, 64, 999, 32),   # Llama-3.2-1B's heads
    (1, 4, 1, 64, 16, 63, 1),        # one split: no combine across splits
    (1, 8, 2, 300, 16, 200, 1),      # a split of four tiles, the last partly committed
    (1, 8, 2, 500, 16, 420, 2),      # 7 tiles for 2 splits: 4 and 3, the last partly committed
])
def test_matches_sdpa_over_the_committed_positions(dtype, stages, batch, query_heads, kv_heads, capacity, head_dim,
                                                   position, splits):
    query, key, value = _inputs(batch, query_heads, kv_heads, capacity, head_dim, dtype)
    # Past the committed positions the cache holds what a longer sequence left: it must not be read.
    key[:, :, position + 1:] = float("nan")
    value[:, :, position + 1:] = float("nan")
    scale = head_dim ** -0.5
    out = torch.empty(batch, 1, query_heads, head_dim, device=DEVICE, dtype=dtype)
    fd.launch(query, key, value, torch.tensor([position], device=DEVICE), scale, out, splits, stages=stages)
    torch.testing.assert_close(out.float(), _reference(query, key, value, position, scale), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("position", [64, 500, 2**32 + 5])
def test_a_position_past_the_capacity_reads_no_further_than_the_capacity(position):
    query, key, value = _inputs(1, 4, 2, 96, 16, torch.float16)
    key[:, :, 64:] = float("nan")  # what lies past a capacity of 64, in the same storage
    key, value = key[:, :, :64], value[:, :, :64]
    out = torch.empty(1, 1, 4, 16, device=DEVICE, dtype=torch.float16)
    fd.launch(query, key, value, torch.tensor([position], device=DEVICE), 0.25, out, 4)
    torch.testing.assert_close(out.float(), _reference(query, key, value, 63, 0.25), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("splits, block_n, position", [
    (64, 16, 64 * 16),        # 65 tiles: in chunks of two, 31 splits would read nothing
    (32, 16, 32 * 16 + 300),  # 51 tiles
    (8, 16, 8 * 16),          # 9 tiles
])
def test_every_split_reads_once_there_are_as_many_tiles_as_splits(splits, block_n, position):
    query, key, value = _inputs(1, 4, 1, position + 1, 16, torch.float16)
    out = torch.empty(1, 1, 4, 16, device=DEVICE, dtype=torch.float16)
    maxima = []

    def recording_the_split_maxima(kernel):
        if kernel is not fd._split_kernel:
            return kernel

        class Recorded:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    maxima.append(args[4])
                    return kernel[grid](*args, **kwargs)
                return run
        return Recorded()

    fd.launch(query, key, value, torch.tensor([position], device=DEVICE), 0.25, out, splits, block_n=block_n,
              launcher=recording_the_split_maxima)
    # A split that read nothing stores a running maximum of -inf.
    idle = torch.isinf(maxima[0].view(splits, -1)[:, :4]).all(dim=1)
    assert not idle.any(), f"{int(idle.sum())} of {splits} splits read nothing"
    torch.testing.assert_close(out.float(), _reference(query, key, value, position, 0.25), rtol=2e-2, atol=2e-2)


def test_splits_fill_the_multiprocessors_in_powers_of_two():
    assert fd.splits_for(8, 132) == 64          # Llama-3.2-1B's 8 KV heads on an H200
    assert fd.splits_for(1, 132) == fd.MAX_SPLITS
    assert fd.splits_for(1024, 132) == 1


@pytest.mark.parametrize("change, named", [
    (lambda q, k, v: (q.expand(1, 8, 2, 16), k, v), "query: one token per sequence"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)),
     "8 query heads are not a multiple of key's 3"),
    (lambda q, k, v: (q, k.float(), v), "key is torch.float32"),
    (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), "head size 12 is not a power of two of 16"),
    (lambda q, k, v: (q, k, v[:, :, :8]), "value's shape"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), "has no heads or no positions"),
    (lambda q, k, v: (q, k[:, :0], v[:, :0]), "has no heads or no positions"),
])
def test_inputs_the_kernels_cannot_take_are_refused_by_name(change, named):
    query, key, value = change(*_inputs(1, 8, 2, 32, 16, torch.float16))
    with pytest.raises(FlashDecodeError, match=f"flash_decode: .*{named}"):
        fd.check_inputs(query, key, value, torch.tensor([3], device=DEVICE))


@pytest.mark.parametrize("position, named", [
    (torch.tensor([3.0]), "position must be one integer"),
    (torch.tensor([True]), "position must be one integer"),
    (torch.tensor([3, 4]), "position must be one integer"),
    (torch.tensor([3], device="meta"), "position is on meta"),
])
def test_a_position_the_kernels_cannot_take_is_refused_by_name(position, named):
    query, key, value = _inputs(1, 8, 2, 32, 16, torch.float16)
    if position.device.type != "meta":
        position = position.to(DEVICE)
    with pytest.raises(FlashDecodeError, match=f"flash_decode: {named}"):
        fd.check_inputs(query, key, value, position)


@pytest.mark.parametrize("splits, block_n, named", [
    (3, 64, "3 splits; the combine takes a power of two"),
    (4, 48, "block_n 48; a tile is a power of two of 16 or more"),
    (4, 8, "block_n 8; a tile is a power of two of 16 or more"),
])
def test_launch_parameters_the_kernels_cannot_take_are_refused_by_name(splits, block_n, named):
    query, key, value = _inputs(1, 8, 2, 32, 16, torch.float16)
    out = torch.empty(1, 1, 8, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(FlashDecodeError, match=f"flash_decode: {named}"):
        fd.launch(query, key, value, torch.tensor([3], device=DEVICE), 0.25, out, splits, block_n=block_n)


@pytest.mark.parametrize("stages", [0, -1])
def test_stages_the_sweep_cannot_take_are_refused_by_name(stages):
    query, key, value = _inputs(1, 8, 2, 32, 16, torch.float16)
    out = torch.empty(1, 1, 8, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(FlashDecodeError, match=f"flash_decode: {stages} stages; the sweep takes 1 or more"):
        fd.launch(query, key, value, torch.tensor([3], device=DEVICE), 0.25, out, 4, stages=stages)


@pytest.mark.skipif(not CUDA, reason="the operator's kernels compiled for CUDA: under the interpreter or without CUDA")
def test_the_operator_compiles_into_a_cuda_graph_and_replays_at_any_position():
    query, key, value = _inputs(1, 32, 8, 4096, 64, torch.bfloat16)
    position = torch.tensor([0], device=DEVICE)
    step = torch.compile(lambda q, k, v, p: torch.ops.zerokv.flash_decode(q, k, v, p, 0.125), fullgraph=True)
    step(query, key, value, position)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(query, key, value, position)
    for committed in (1, 700, 4096):
        position.fill_(committed - 1)
        graph.replay()
        torch.testing.assert_close(out.float(), _reference(query, key, value, committed - 1, 0.125),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not CUDA, reason="the operator's kernels compiled for CUDA: under the interpreter or without CUDA")
def test_one_compiled_step_serves_every_capacity():
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v, p: torch.ops.zerokv.flash_decode(q, k, v, p, 0.125), fullgraph=True,
                         dynamic=True)
    for capacity, position in ((512, 300), (2048, 1500), (64, 63)):
        query, key, value = _inputs(1, 32, 8, capacity, 64, torch.bfloat16, seed=capacity)
        # The capacity is a kernel argument, not a constant: a new one must not compile again.
        with torch._dynamo.config.patch(error_on_recompile=capacity != 512):
            got = step(query, key, value, torch.tensor([position], device=DEVICE))
        torch.testing.assert_close(got.float(), _reference(query, key, value, position, 0.125), rtol=2e-2, atol=2e-2)


def test_a_step_exports_on_the_cpu_with_a_dynamic_capacity():
    # The bench exports its programs from CPU tensors and compiles them for CUDA: the operator's
    # checks and fake must take a symbolic capacity without a device to ask.
    class Attend(torch.nn.Module):
        def forward(self, query, key, value, position):
            return torch.ops.zerokv.flash_decode(query, key, value, position, 0.125)

    query, key, value = (tensor.cpu() for tensor in _inputs(1, 32, 8, 512, 64, torch.bfloat16))
    capacity = torch.export.Dim("capacity", min=16, max=1 << 16)
    program = torch.export.export(Attend(), (query, key, value, torch.tensor([300])),
                                  dynamic_shapes=(None, {2: capacity}, {2: capacity}, None))
    [call] = [node for node in program.graph.nodes if node.target is torch.ops.zerokv.flash_decode.default]
    assert list(call.meta["val"].shape) == [1, 1, 32, 64]
    assert isinstance(call.args[1].meta["val"].shape[2], torch.SymInt)  # the capacity stayed dynamic
