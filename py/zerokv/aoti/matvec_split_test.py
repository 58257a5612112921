import pytest
import torch
from torch._inductor.choices import InductorChoices

from zerokv.aoti.matvec_split import MIN_PIECE, ROWS, MatvecSplitChoices, matvec_split

CPU = torch.device("cpu")


def test_a_down_projection_is_split_into_the_rows_of_the_gate_and_up_product():
    # Llama-3.2-1B: down 2048 outputs over 8192 inputs; gate and up 8192 outputs over 2048.
    assert matvec_split(2048, 8192) == 4
    assert matvec_split(8192, 2048) == 1


@pytest.mark.parametrize("outputs, reduction", [(512, 2048), (2048, 2048), (1, 4096)])
def test_products_under_16_mib_of_weights_are_not_split(outputs, reduction):
    assert matvec_split(outputs, reduction) == 1


@pytest.mark.parametrize("outputs, reduction", [(1024, 1 << 16), (2048, 8190), (4096, 3 * 1024), (16, 1 << 20)])
def test_every_piece_is_whole_and_at_least_the_minimum(outputs, reduction):
    split = matvec_split(outputs, reduction)
    assert reduction % split == 0 and reduction // split >= MIN_PIECE
    assert outputs * split <= max(ROWS, outputs)


def test_inductors_own_split_and_outer_reductions_are_kept():
    choices = MatvecSplitChoices()
    for numel, reduction, inner in [(1, 1 << 20, True), (2048, 8192, False), (64, 1 << 22, False)]:
        assert choices.reduction_split_factor(CPU, reduction, numel, inner) == \
            InductorChoices.reduction_split_factor(CPU, reduction, numel, inner)
    assert choices.reduction_split_factor(CPU, 8192, 2048, True) == 4
