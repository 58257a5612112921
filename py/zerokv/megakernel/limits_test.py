"""The shapes export refuses are the shapes the kernel refuses: llama_step's limits equal the
kernel header's (the C++ refuses at load, export before any GPU is at hand)."""
import os
import re

import pytest

from zerokv.megakernel import llama_step

HEADER = os.environ["ZEROKV_MEGAKERNEL_HEADER"]
LIMITS = {"kHeadDim": llama_step.HEAD_DIM, "kGroup": llama_step.QUERY_HEADS_PER_KV_HEAD,
          "kMaxLayers": llama_step.MAX_LAYERS, "kSegment": llama_step.SEGMENT,
          "kMaxWidth": llama_step.MAX_WIDTH}


def header_constants() -> dict[str, int]:
    with open(HEADER) as f:
        return {name: int(value) for name, value in
                re.findall(r"^inline constexpr int (k\w+) = (\d+);", f.read(), flags=re.MULTILINE)}


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_export_refuses_what_the_kernel_refuses(name):
    constants = header_constants()
    assert name in constants, f"{HEADER} no longer declares {name} as `inline constexpr int {name} = N;`"
    assert constants[name] == LIMITS[name], f"{name} is {constants[name]} in the kernel, {LIMITS[name]} in llama_step"
