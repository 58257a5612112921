"""The step of llama_decode_step.h over a transformers Llama model's own tensors, through ctypes.

    library = load(path_to_libzerokv_megakernel_so)
    step = LlamaDecodeStep(library, model, keys, values)  # keys/values: [kv_heads, capacity, head_dim]
    step.token.fill_(token); step.position.fill_(position); step.launch()  # step.logits: [vocab]

The step reads the model's weights where they are (only q, k and v are packed into one matrix) and
updates `keys` and `values` in place. `check_against_transformers` is its contract as a check: the
same step through transformers' StaticCache, both measured against float32; `check_refusals` and
`check_repeatable` check its guards and that the same inputs give the same bits.
"""

from __future__ import annotations

import copy
import ctypes
import os
import subprocess

import torch

from tools.bench import static_cache
from zerokv.megakernel.llama_step import LAYER_WEIGHTS, model_weights, unsupported_model

BAD_POSITION = 1  # kBadPosition in llama_decode_step.h
BAD_TOKEN = 2  # kBadToken


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SOURCES = ["cc/engines/megakernel/llama_decode_step.cu", "cc/engines/megakernel/c_api.cc"]


def build_with_nvcc(library: str, defines=(), root: str = ROOT) -> str:
    """libzerokv_megakernel.so built at `library` by the nvcc on PATH, with `defines` (MACRO=VALUE),
    from the sources under `root` (another checkout's, to compare commits): for a GPU machine's
    scripts that build variants without Bazel. The flags are cuda_library's (tools/cuda/defs.bzl),
    which Bazel's build of the same library uses."""
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", f"-I{root}",
                    *[f"-D{d}" for d in defines], *[os.path.join(root, s) for s in SOURCES], "-o", library],
                   check=True)
    return library


def load(path: str) -> ctypes.CDLL:
    library = ctypes.CDLL(path)
    library.zerokv_megakernel_workspace_bytes.restype = ctypes.c_size_t
    library.zerokv_megakernel_workspace_bytes.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p,
                                                          ctypes.c_size_t]
    library.zerokv_megakernel_launch.restype = ctypes.c_int
    library.zerokv_megakernel_launch.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_double, ctypes.c_double,
                                                 ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64, ctypes.c_char_p,
                                                 ctypes.c_size_t]
    return library


def _device_tensor(name, tensor, dtype):
    if not (tensor.is_cuda and tensor.dtype == dtype and tensor.is_contiguous()):
        raise ValueError(f"{name}: {tensor.dtype} on {tensor.device}, contiguous {tensor.is_contiguous()}; "
                         f"the step needs a contiguous {dtype} CUDA tensor")
    return tensor


class LlamaDecodeStep:
    """One decode step of `model` over the caches `keys` and `values` ([kv_heads, capacity, head_dim]
    per layer), reading `token` and `position` from device scalars and writing `logits`."""

    def __init__(self, library, model, keys, values):
        config = model.config
        reason = unsupported_model(model)
        if reason:
            raise ValueError(f"model: {reason}")
        if len(keys) != config.num_hidden_layers or len(values) != config.num_hidden_layers:
            raise ValueError(f"{len(keys)} key and {len(values)} value caches for {config.num_hidden_layers} layers")
        bf16 = torch.bfloat16
        self.library = library
        self.shape = (ctypes.c_int64 * 8)(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                          config.num_key_value_heads, config.head_dim, config.intermediate_size,
                                          config.vocab_size, keys[0].shape[1])
        cache_shape = (config.num_key_value_heads, keys[0].shape[1], config.head_dim)
        for name, caches in (("keys", keys), ("values", values)):
            for index, cache in enumerate(caches):
                if tuple(cache.shape) != cache_shape:
                    raise ValueError(f"{name}[{index}] is {tuple(cache.shape)}, not {cache_shape}")
        error = ctypes.create_string_buffer(512)
        workspace_bytes = library.zerokv_megakernel_workspace_bytes(self.shape, error, len(error))
        if workspace_bytes == 0:
            raise ValueError(error.value.decode())
        weights = model_weights(model)
        self.keep = weights  # the packed qkv matrices, alive as long as the step
        tensors = []
        for index in range(config.num_hidden_layers):
            tensors += [(name, tensor, bf16) for name, tensor in weights[index * len(LAYER_WEIGHTS):][:len(LAYER_WEIGHTS)]]
            tensors += [(f"keys[{index}]", keys[index], bf16), (f"values[{index}]", values[index], bf16)]
        named = dict(weights)
        self.attention_scaling = float(model.model.rotary_emb.attention_scaling)
        device = keys[0].device
        self.token = torch.zeros((), dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.logits = torch.zeros(config.vocab_size, dtype=bf16, device=device)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.step_error = torch.zeros(1, dtype=torch.int32, device=device)
        # c_api.cc's order after the layers.
        tensors += [("embedding", named["embedding"], bf16), ("final_norm", named["final_norm"], bf16),
                    ("lm_head", named["lm_head"], bf16), ("inv_freq", named["inv_freq"], torch.float32),
                    ("token", self.token, torch.long), ("position", self.position, torch.long),
                    ("logits", self.logits, bf16), ("workspace", self.workspace, torch.uint8),
                    ("step_error", self.step_error, torch.int32)]
        self.pointers = (ctypes.c_uint64 * len(tensors))(
            *[_device_tensor(name, tensor, dtype).data_ptr() for name, tensor, dtype in tensors])
        self.rms_eps = float(config.rms_norm_eps)

    def launch(self):
        """Enqueues the step on torch's current stream (capturable in a CUDA graph)."""
        error = ctypes.create_string_buffer(512)
        status = self.library.zerokv_megakernel_launch(self.shape, self.rms_eps, self.attention_scaling,
                                                       self.pointers, torch.cuda.current_stream().cuda_stream,
                                                       error, len(error))
        if status != 0:
            raise RuntimeError(f"the megakernel step failed (CUDA error {status}): {error.value.decode()}")

    def error_word(self) -> int:
        """BAD_POSITION or BAD_TOKEN when a step since step_error was zeroed refused its input (synchronous)."""
        return int(self.step_error.item())


def float32_reference(model, cache):
    """A float32 copy of `model` and of its StaticCache `cache` (the same weights and history): the
    computation both BF16 steps approximate."""
    reference = copy.deepcopy(model).float()
    reference_cache = static_cache.allocated(reference, cache.layers[0].keys.shape[2])
    for ours, theirs in zip(reference_cache.layers, cache.layers):
        ours.keys.copy_(theirs.keys)
        ours.values.copy_(theirs.values)
    return reference, reference_cache


def _decode(model, cache, token, position, device):
    static_cache.place(cache, position)
    with torch.no_grad():
        return model(input_ids=torch.tensor([[token]], device=device),
                     position_ids=torch.tensor([[position]], device=device), past_key_values=cache,
                     use_cache=True).logits[0, -1].float()


def check_against_transformers(model, step, cache, keys, values, positions, reference, report=print):
    """Mismatches of `step` against transformers' decode step, as lines. `cache` is transformers'
    StaticCache over the same history as `keys` and `values`; `reference` is float32_reference's
    (model, cache). At each of `positions` (ascending) the step and transformers' BF16 step run, and
    each is measured against the float32 step: the step may be off it by at most twice as much as
    transformers' BF16 step is, plus one BF16 rounding (its logits by cosine distance, every layer's
    K and V rows by their largest difference); its top-1 is the float32 one unless the float32 top
    two are within the step's error; the cache row after `position` is unchanged."""
    failures = []
    vocab = model.config.vocab_size
    device = keys[0].device
    reference_model, reference_cache = reference
    for position in positions:
        token = (position * 7 + 3) % vocab
        theirs = _decode(model, cache, token, position, device)
        exact = _decode(reference_model, reference_cache, token, position, device)
        step.token.fill_(token)
        step.position.fill_(position)
        step.launch()
        torch.cuda.synchronize()
        ours = step.logits.float()
        distance = {name: 1 - torch.nn.functional.cosine_similarity(logits, exact, dim=0).item()
                    for name, logits in (("ours", ours), ("theirs", theirs))}
        worst = (ours - exact).abs().max().item()
        if distance["ours"] > 2 * distance["theirs"] + 1e-5:
            failures.append(f"position {position}: logits' cosine distance to float32 {distance['ours']:.3g}, "
                            f"transformers' BF16 {distance['theirs']:.3g}")
        best, second = exact.topk(2).values.tolist()
        if int(ours.argmax()) != int(exact.argmax()) and best - second > 2 * worst:
            failures.append(f"position {position}: top-1 {int(ours.argmax())}, float32's {int(exact.argmax())}")
        ratios = []
        for index, (layer, exact_layer) in enumerate(zip(cache.layers, reference_cache.layers)):
            for name, our_rows, their_rows, exact_rows in (
                    ("K", keys[index], layer.keys[0], exact_layer.keys[0]),
                    ("V", values[index], layer.values[0], exact_layer.values[0])):
                row = exact_rows[:, position]
                our_error = (our_rows[:, position].float() - row).abs().max().item()
                their_error = (their_rows[:, position].float() - row).abs().max().item()
                rounding = row.abs().max().item() / 128
                ratios.append(our_error / max(their_error, rounding))
                if our_error > 2 * their_error + rounding:
                    failures.append(f"position {position}: layer {index} {name} row off float32 by {our_error:.4g}, "
                                    f"transformers' BF16 by {their_error:.4g}")
                if position + 1 < our_rows.shape[1] and not torch.equal(our_rows[:, position + 1],
                                                                         their_rows[:, position + 1]):
                    failures.append(f"position {position}: layer {index} {name} row {position + 1} changed")
        report(f"at {position}: logits' cosine distance to float32 {distance['ours']:.3g} (transformers' BF16 "
               f"{distance['theirs']:.3g}), top-1 {'same' if int(ours.argmax()) == int(exact.argmax()) else 'differs'}; "
               f"K/V rows' error over transformers' at most {max(ratios):.2f}x")
    return failures


def check_refusals(step, keys, values):
    """Mismatches of the step's guards, as lines: a position at the cache's capacity, a negative one
    and a token outside the vocabulary each set the error word, write no cache row and leave every
    logit NaN. Leaves the error word zeroed."""
    failures = []
    capacity, vocab = keys[0].shape[1], step.logits.shape[0]
    for what, token, position, word in (("position at the capacity", 0, capacity, BAD_POSITION),
                                        ("negative position", 0, -1, BAD_POSITION),
                                        ("token at the vocabulary's size", vocab, 5, BAD_TOKEN)):
        before = [cache.clone() for cache in (keys[0], values[0], keys[-1], values[-1])]
        step.step_error.zero_()
        step.logits.fill_(7.0)
        step.token.fill_(token)
        step.position.fill_(position)
        step.launch()
        torch.cuda.synchronize()
        if step.error_word() != word:
            failures.append(f"{what}: error word {step.error_word()}, not {word}")
        after = (keys[0], values[0], keys[-1], values[-1])
        if not step.logits.isnan().all():
            failures.append(f"{what}: {int((~step.logits.isnan()).sum())} logits are not NaN")
        if not all(torch.equal(b, a) for b, a in zip(before, after)):
            failures.append(f"{what}: the step wrote cache rows")
    step.step_error.zero_()
    return failures


def check_repeatable(step, keys, values, positions, launches):
    """Mismatches of the step's determinism, as lines: from the same caches, token and position, every
    launch must give the first's logits and K/V rows bit for bit (every sum runs in one order, so
    a difference is a race). Leaves the caches as they were before the first launch. Raises
    ValueError, before any launch, for fewer than two launches or no positions (nothing would be
    compared) and for a position outside the caches (the step refuses it, and NaN logits never
    compare equal)."""
    if launches < 2 or not positions:
        raise ValueError(f"check_repeatable compares launches with the first: {launches} launches at "
                         f"{len(positions)} positions compare nothing")
    capacity = keys[0].shape[1]
    if outside := [p for p in positions if not 0 <= p < capacity]:
        raise ValueError(f"positions {outside} are outside the caches' {capacity} positions")
    failures = []
    saved = [cache.clone() for cache in keys + values]
    for position in positions:
        first = None
        for launch in range(launches):
            for cache, before in zip(keys + values, saved):
                cache.copy_(before)
            step.token.fill_(3)
            step.position.fill_(position)
            step.launch()
            torch.cuda.synchronize()
            result = (step.logits.clone(), [cache[:, position].clone() for cache in keys + values])
            if first is None:
                first = result
                continue
            if not torch.equal(result[0], first[0]):
                difference = (result[0].float() - first[0].float()).abs().max().item()
                failures.append(f"at {position}: launch {launch}'s logits differ from the first's by up to {difference:.3g}")
            if not all(torch.equal(row, row0) for row, row0 in zip(result[1], first[1])):
                failures.append(f"at {position}: launch {launch}'s K/V rows differ from the first's")
    for cache, before in zip(keys + values, saved):
        cache.copy_(before)
    return failures
