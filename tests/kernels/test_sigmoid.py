"""The sigmoid-loss tile kernel against the plain-torch reference (float64) on ragged shapes, with
and without gradients, in every input dtype (CPU: through TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels import torch_tiles, triton_tiles

from .test_tiles import CASES


def block(m: int, n: int, c: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows = F.normalize(torch.randn(m, c, generator=generator, dtype=torch.float64), dim=-1)
    cols = F.normalize(torch.randn(n, c, generator=generator, dtype=torch.float64), dim=-1)
    return rows, cols


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m, n, c, diagonal", [(37, 37, 24, True), (50, 29, 40, False), (17, 70, 130, False)])
def test_sigmoid_block_matches_the_float64_reference(case, m, n, c, diagonal):
    dtype, precision, tolerance = CASES[case]
    rows, cols = block(m, n, c, seed=m + n + c)
    rows, cols = rows.to(dtype), cols.to(dtype)  # both sides see the same rounded inputs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scale, bias = torch.tensor(10.0), torch.tensor(-4.0)
    ref_rows, ref_cols = torch.zeros(m, c, dtype=torch.float64), torch.zeros(n, c, dtype=torch.float64)
    expected = torch_tiles.sigmoid_block(rows.double(), cols.double(), scale.double(), bias.double(), diagonal,
                                         ref_rows, ref_cols, tile=16)
    d_rows = torch.zeros(m, c, device=device)
    d_cols = torch.zeros(n, c, device=device)
    got = triton_tiles.sigmoid_block(rows.to(device), cols.to(device), scale.to(device), bias.to(device), diagonal,
                                     d_rows, d_cols, fp32_precision=precision)
    for name, value, reference in zip(("loss", "scale", "bias"), got, expected, strict=True):
        assert abs(float(value) / float(reference) - 1) <= tolerance, name
    assert (d_rows.cpu().double() - ref_rows).norm() / ref_rows.norm() <= tolerance
    assert (d_cols.cpu().double() - ref_cols).norm() / ref_cols.norm() <= tolerance
    alone = triton_tiles.sigmoid_block(rows.to(device), cols.to(device), scale.to(device), bias.to(device), diagonal,
                                       fp32_precision=precision)[0]
    assert torch.equal(alone, got[0])  # the loss-only path (no G written) gives the same sum


def test_sigmoid_block_wants_both_accumulators_or_neither():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, cols = (x.float().to(device) for x in block(8, 8, 16, seed=0))
    with pytest.raises(ValueError, match="both d_rows and d_cols"):
        triton_tiles.sigmoid_block(rows, cols, torch.tensor(1.0, device=device), torch.tensor(0.0, device=device),
                                   True, d_rows=torch.zeros(8, 16, device=device))
