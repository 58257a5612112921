"""Writes the AOTInductor .pte programs of the execution tests (a build step, so the compile is cached).

    make_test_programs.py ZERO_COPY.pte STAGED.pte
Both are a decode step of zerokv.tensorrt.testing_models.TinyDecoder (fixed seed), compiled for the
CPU and delegated to cuda:0 (run over a host-memory device allocator): one with zero-copy KV and its
weights in a data file beside it (ZERO_COPY.ptd, the default), one with plain ExecuTorch staging and
copy-back and its weights in the .pte (named_data="pte").
"""

import sys

import torch

import zerokv.executorch as zx
from zerokv.tensorrt import testing_models as tm


def decode_program():
    return tm.export_decoder(tm.TinyDecoder(tm.arange_plus_offset), 1, torch.tensor([0]))


def main():
    zero_copy_path, staged_path = sys.argv[1:]
    options = {"compile_device": "cpu"}
    zx.save(zx.export(decode_program(), engine="aoti", engine_options=options), zero_copy_path)
    staged = zx.export(decode_program(), engine="aoti", engine_options=options, zero_copy_kv=False,
                       named_data="pte")
    zx.save(staged, staged_path)


if __name__ == "__main__":
    main()
