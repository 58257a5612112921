"""CacheInputs off the CPU: a step built on the device of its inputs (meta here, standing in for
CUDA, where a CPU-made position range broke torch.compile of the step)."""

import torch

from zerokv.executorch import hf_decoders as hf


def test_a_step_runs_on_the_device_of_its_inputs():
    model = hf.tiny("llama")
    step = hf.CacheInputs(model).to("meta")
    caches = [torch.zeros(hf.cache_shape(model.config, 16), dtype=model.dtype, device="meta")
              for _ in range(2 * model.config.num_hidden_layers)]
    logits = step(torch.zeros(1, 1, dtype=torch.long, device="meta"), torch.tensor([3], device="meta"), *caches)
    assert (logits.device.type, tuple(logits.shape)) == ("meta", (1, 1, model.config.vocab_size))
