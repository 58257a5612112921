"""A transformers Llama model's decode step through zerokv.export's MEGAKERNEL delegate, run by
ExecuTorch's runtime with zerokv's CUDA backend (an sm_90 GPU): every step's logits against
transformers' own BF16 step, through the growths of the runtime-owned caches. The program runs in
//cc/runtime/testing:decode_tokens, through ExecuTorch's C++ runtime: its Python runtime cannot
execute on the GPU machine (decode_tokens.cc says why)."""

import array
import os
import subprocess

import torch
import transformers

import zerokv.executorch as zx
from zerokv.megakernel.export import export_decode
from zerokv.megakernel.testing import small_model

DECODE_TOKENS = os.environ["ZEROKV_DECODE_TOKENS"]
STEPS = 40  # from position 0: the caches grow from 16 positions to 32 and 64


def transformers_steps(model, first_token: int) -> tuple[list[int], torch.Tensor]:
    """The tokens fed at positions [0, STEPS) of transformers' greedy decode and their logits."""
    history = transformers.DynamicCache(config=model.config)
    tokens, logits = [first_token], []
    with torch.no_grad():
        for _ in range(STEPS):
            step = model(torch.tensor([[tokens[-1]]], device="cuda"), past_key_values=history, use_cache=True).logits
            logits.append(step.float().cpu().flatten())
            tokens.append(int(step.argmax()))
    return tokens[:STEPS], torch.stack(logits)


def test_the_program_decodes_as_transformers(tmp_path):
    model = small_model()
    program, runtime_kv = export_decode(model, max_capacity=128, initial_capacity=16)
    pte = str(tmp_path / "decode.pte")
    zx.save(zx.export({"decode": program}, engine="megakernel", runtime_kv=runtime_kv), pte)
    tokens, theirs = transformers_steps(model.cuda(), first_token=7)
    (tmp_path / "tokens.bin").write_bytes(array.array("q", tokens).tobytes())
    subprocess.run([DECODE_TOKENS, pte, zx.data_path(pte), "decode", str(tmp_path / "tokens.bin"),
                    str(tmp_path / "logits.bin")], check=True)
    ours = torch.frombuffer(bytearray((tmp_path / "logits.bin").read_bytes()), dtype=torch.float32)
    assert ours.numel() == theirs.numel(), f"{ours.numel()} logits for {STEPS} steps of {theirs.shape[1]}"
    for position, cosine in enumerate(torch.nn.functional.cosine_similarity(ours.view_as(theirs), theirs, dim=1)):
        assert cosine > 0.999, f"position {position}: cosine {cosine:.5f} to transformers' step"
