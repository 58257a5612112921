"""Writes a zerokv blob (engine kind AOTI) for a one-layer decode step, for the runtime's tests.

    make_decode_blob.py OUT.blob [--device cpu|cuda] [--not-elided] [--weighted]

The step: `k_cache.index_copy_(2, pos, x)` on a [1, 2, 8, 4] cache, returning
`attention = (k_cache * 2).sum(2)` ([1, 2, 4]): a value that reads every cached position, so a
second step proves it saw the first step's write. --weighted scales by a weight instead,
`(k_cache @ weight).sum(2)` with weight = diag(2, 3, 4, 5): the blob's one constant, which goes to
OUT.ptd (the named data format of a .pte's data file).
"""

import argparse
import os

import torch
from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

from zerokv import blob
from zerokv.aoti import NAMED_DATA_ALIGNMENT, compile_aoti

POSITIONS = 8
# Inductor compiles a uniform weight, or one of fewer than 16 elements, into the code: a 4x4 matrix
# that is not uniform stays a constant.
SCALE = (2.0, 3.0, 4.0, 5.0)


class DecodeStep(torch.nn.Module):
    def forward(self, x, pos, k_cache):
        k_cache.index_copy_(2, pos, x)
        return (k_cache * 2).sum(2)


class WeightedDecodeStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.diag(torch.tensor(SCALE)))

    def forward(self, x, pos, k_cache):
        k_cache.index_copy_(2, pos, x)
        return (k_cache @ self.weight).sum(2)


def example_inputs():
    return (torch.ones(1, 2, 1, 4), torch.tensor([3]), torch.zeros(1, 2, POSITIONS, 4))


def write_named_data(named_data, path):
    """`named_data` ({key: bytes}) as a .ptd: what ExecuTorch writes for a program's data file."""
    keys = list(named_data)
    payload = DataPayload(
        buffers=[named_data[key] for key in keys],
        named_data={key: DataEntry(i, NAMED_DATA_ALIGNMENT, None) for i, key in enumerate(keys)},
    )
    with open(path, "wb") as out:
        FlatTensorSerializer().serialize(payload).write_to_file(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--not-elided", action="store_true")
    parser.add_argument("--weighted", action="store_true")
    args = parser.parse_args()
    step = WeightedDecodeStep() if args.weighted else DecodeStep()
    # Planned in (stand-in) CUDA memory either way: the delegate is a device delegate.
    with torch.no_grad():
        build = compile_aoti(step, example_inputs(), args.device, binding_device=blob.Device.CUDA)
    data = blob.serialize(
        blob.Blob(
            engine_kind=blob.EngineKind.AOTI,
            device_id=0,
            aliased_outputs_elided=not args.not_elided,
            metadata=blob.Metadata(bindings=build.bindings, aliased_io=build.aliased_io, kv_layers=[],
                                   step_width_source="", constants=build.constants),
            payload=build.payload,
        )
    )
    with open(args.out, "wb") as out:
        out.write(data)
    if build.named_data:
        write_named_data(build.named_data, os.path.splitext(args.out)[0] + ".ptd")


if __name__ == "__main__":
    main()
