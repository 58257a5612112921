"""Exports a one-step decoder with a static KV cache through zerokv's public API.

    export_tiny_decoder.py OUT.pte

writes OUT.pte and its weights beside it (OUT.ptd). Each step writes 2 * x (x times the weight
2 * identity) into the cache at `position` (index_copy_, as Hugging Face's static cache does) and
returns the sum of the cache over positions 0..position, so after steps x_0..x_n the output is
2 * (x_0 + ... + x_n): the C++ runner can tell that every step's write reached the cache.
Positions after `position` are masked out: ExecuTorch does not initialise a mutated buffer.
"""

import sys

import torch
from torch import nn

import zerokv.executorch

WIDTH, MAX_POSITIONS = 4, 8


class TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, 1, MAX_POSITIONS, WIDTH))
        self.weight = nn.Parameter(2 * torch.eye(WIDTH))

    def forward(self, x, position):
        positions = torch.arange(1) + position
        self.k_cache.index_copy_(2, positions, (x @ self.weight).view(1, 1, 1, WIDTH))
        written = (torch.arange(MAX_POSITIONS) <= position).view(1, 1, MAX_POSITIONS, 1)
        return torch.where(written, self.k_cache, 0.0).sum(dim=2).view(WIDTH)


def main():
    (out,) = sys.argv[1:]
    with torch.no_grad():
        program = torch.export.export(TinyDecoder().eval(), (torch.zeros(WIDTH), torch.tensor([0])))
    manager = zerokv.executorch.export(program, engine="aoti", engine_options={"compile_device": "cpu"})
    zerokv.executorch.save(manager, out)


if __name__ == "__main__":
    main()
