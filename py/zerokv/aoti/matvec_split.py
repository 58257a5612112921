"""Splits a one-token matrix product with few outputs along its reduction, so that it fills the GPU.

Under coordinate-descent tuning, Inductor compiles a one-token matrix product as a Triton reduction:
one output element per row of the weight. Inductor splits a reduction in two kernels only when it
has fewer outputs than twice the device's SMs, so a product with 2048 outputs over 8192 inputs (a
1B decoder's down projection, 32 MiB of weights) runs as 2048 long rows. On an H200 that streams
its weights at under 2 TB/s, while the gate-and-up product (8192 outputs over 2048) streams them
at about 4.6 TB/s. `MatvecSplitChoices` (an Inductor choices handler) splits such a product into
`ROWS` rows of at least `MIN_PIECE` inputs each; a second, small kernel adds the pieces. Only
products of at least `MIN_ELEMENTS` weights are split: below that, the second kernel costs more
than the split gains.
"""

from __future__ import annotations

from torch._inductor.choices import InductorChoices

ROWS = 8192  # the gate-and-up product's shape, which streams at the bandwidth
MIN_PIECE = 512
MIN_ELEMENTS = 8 << 20  # 16 MiB of bfloat16 weights


def matvec_split(outputs: int, reduction: int) -> int:
    """How many pieces to split a reduction of `outputs` rows over `reduction` elements into:
    doubling while the rows stay under ROWS and each piece keeps an even MIN_PIECE or more."""
    split = 1
    if outputs * reduction < MIN_ELEMENTS:
        return split
    while outputs * split < ROWS and reduction % (2 * split) == 0 and reduction // (2 * split) >= MIN_PIECE:
        split *= 2
    return split


class MatvecSplitChoices(InductorChoices):
    """Inductor's choices, with large matrix-vector reductions split by `matvec_split`."""

    @staticmethod
    def reduction_split_factor(device, reduction_numel_hint: int, numel_hint: int, inner_reduction: bool) -> int:
        inductor_split = InductorChoices.reduction_split_factor(device, reduction_numel_hint, numel_hint,
                                                                inner_reduction)
        if not inner_reduction or inductor_split > 1:
            return inductor_split
        return matvec_split(numel_hint, reduction_numel_hint)
