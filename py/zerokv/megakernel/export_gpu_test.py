"""A transformers Llama model's decode step through zerokv.export's MEGAKERNEL delegate, run by
ExecuTorch's runtime with zerokv's CUDA backend (an sm_90 GPU): every step's logits against
transformers' own BF16 step, through the growths of the runtime-owned caches."""

import ctypes
import os

import torch
import transformers

BACKEND = ctypes.CDLL(os.environ["ZEROKV_BACKEND_CUDA_SO"], os.RTLD_GLOBAL)
import zerokv.executorch as zx  # noqa: E402  (the backend must be registered first)
from zerokv.megakernel.export import export_decode  # noqa: E402
from zerokv.megakernel.testing import small_model  # noqa: E402

STEPS = 40  # from position 0: the caches grow from 16 positions to 32 and 64


def test_the_program_decodes_as_transformers(tmp_path):
    model = small_model()
    program, runtime_kv = export_decode(model, max_capacity=128, initial_capacity=16)
    path = str(tmp_path / "decode.pte")
    zx.save(zx.export({"decode": program}, engine="megakernel", runtime_kv=runtime_kv), path)
    method = zx.load_program(path).load_method("decode")
    reference = model.cuda()
    history = transformers.DynamicCache(config=model.config)
    token = 7
    with torch.no_grad():
        for position in range(STEPS):
            # The runtime fills cache_position with the committed length, whatever is passed.
            (ours,) = method.execute([torch.tensor([[token]]), torch.tensor([0])])
            theirs = reference(torch.tensor([[token]], device="cuda"), past_key_values=history, use_cache=True).logits
            cosine = torch.nn.functional.cosine_similarity(ours.float().flatten(), theirs.float().cpu().flatten(), dim=0)
            assert cosine > 0.999, f"position {position}: cosine {cosine:.5f} to transformers' step"
            token = int(theirs.argmax())
