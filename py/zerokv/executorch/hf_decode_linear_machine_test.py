"""Without CUDA and without Triton's interpreter (this target does not set TRITON_INTERPRET), a model
is refused when its linear layers would be switched, and is left as it was."""

import pytest
import torch

from zerokv.executorch import hf_decoders as hf
from zerokv.executorch.hf_decode_linear import DecodeLinearError, MatvecLinear, use_matvec_decode


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_machine_without_cuda_is_refused_when_the_model_is_switched():
    model = hf.tiny("llama").to(torch.bfloat16)
    with pytest.raises(DecodeLinearError, match="no CUDA device .* TRITON_INTERPRET=1"):
        use_matvec_decode(model)
    assert not any(isinstance(module, MatvecLinear) for module in model.modules())
