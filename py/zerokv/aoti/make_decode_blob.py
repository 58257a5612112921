"""Writes a zerokv blob (engine kind AOTI) for a one-layer decode step, for the runtime's tests.

    make_decode_blob.py OUT.blob [--device cpu|cuda] [--elided | --not-elided]

The step: `k_cache.index_copy_(2, pos, x)` on a [1, 2, 8, 4] cache, returning
`attention = (k_cache * 2).sum(2)` ([1, 2, 4]): a value that reads every cached position, so a
second step proves it saw the first step's write.
"""

import argparse

import torch

from zerokv import blob
from zerokv.aoti import compile_aoti

POSITIONS = 8


class DecodeStep(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        k_cache.index_copy_(2, pos, x)
        return (k_cache * 2).sum(2)


def example_inputs():
    return (torch.ones(1, 2, 1, 4), torch.tensor([3]), torch.zeros(1, 2, POSITIONS, 4))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--not-elided", action="store_true")
    args = parser.parse_args()
    # Planned in (stand-in) CUDA memory either way: the delegate is a device delegate.
    build = compile_aoti(DecodeStep(), example_inputs(), args.device, binding_device=blob.Device.CUDA)
    data = blob.serialize(
        blob.Blob(
            engine_kind=blob.EngineKind.AOTI,
            device_id=0,
            aliased_outputs_elided=not args.not_elided,
            metadata=blob.Metadata(bindings=build.bindings, aliased_io=build.aliased_io, kv_layers=[], step_width_source="",
                                   positions_binding=""),
            payload=build.payload,
        )
    )
    with open(args.out, "wb") as out:
        out.write(data)


if __name__ == "__main__":
    main()
