"""The plain-torch tile functions against dense float64 math on irregular shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels.tiles import block_grads, block_lse

from ..helpers import rel_error


@pytest.mark.parametrize("tile", [1, 7, 16, 100])
@pytest.mark.parametrize("diagonal", [False, True])
def test_block_functions_match_dense(tile, diagonal):
    generator = torch.Generator().manual_seed(tile)
    rows = F.normalize(torch.randn(67, 48, generator=generator, dtype=torch.float64), dim=-1)
    cols = F.normalize(torch.randn(67 if diagonal else 45, 48, generator=generator,
                                   dtype=torch.float64), dim=-1)
    scale = torch.tensor(100.0, dtype=torch.float64)
    lse = block_lse(rows, cols, scale, tile)
    torch.testing.assert_close(lse, torch.logsumexp(scale * rows @ cols.T, 1), rtol=1e-12, atol=0)

    rows_, cols_, scale_ = (x.clone().requires_grad_() for x in (rows, cols, scale))
    logits = scale_ * rows_ @ cols_.T
    objective = torch.logsumexp(logits, 1).sum()
    if diagonal:
        objective = objective - logits.diagonal().sum()
    (0.5 * objective).backward()
    d_rows, d_cols, d_scale = block_grads(rows, cols, scale, lse, tile, torch.tensor(0.5), diagonal)
    assert rel_error(d_rows, rows_.grad) < 1e-12
    assert rel_error(d_cols, cols_.grad) < 1e-12
    assert rel_error(d_scale, scale_.grad) < 1e-12


def test_lse_is_stable_for_peaked_logits():
    """Near-duplicate features at scale 100: logits ~100 must not overflow, far ones not vanish."""
    base = F.normalize(torch.randn(1, 32), dim=-1)
    rows = base.repeat(9, 1)
    cols = torch.cat([base, -base, F.normalize(torch.randn(30, 32), dim=-1)])
    lse = block_lse(rows, cols, torch.tensor(100.0), tile=4)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse, torch.logsumexp(100.0 * rows @ cols.T, 1))
