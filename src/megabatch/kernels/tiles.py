"""Plain-torch tiled log-sum-exp and its backward for one block of the similarity matrix.

A block is ``rows [m, c]`` against ``cols [n, c]`` with logits ``scale * rows @ cols^T``. Both
functions walk it in ``tile x tile`` pieces, so no more than one tile of logits exists at a time.
Accumulation is in fp32 (float64 for float64 inputs). The Triton kernels implement the same API.
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_lse(rows: torch.Tensor, cols: torch.Tensor, scale: torch.Tensor, tile: int) -> torch.Tensor:
    """Row-wise ``logsumexp(scale * rows @ cols^T)``: ``[m]`` in the accumulation dtype.

    Column tiles are merged with an online log-sum-exp: the running value starts at minus
    infinity and ``logaddexp`` shifts by the maximum, so no partial ever overflows or underflows.
    """
    acc = accumulation_dtype(rows.dtype)
    out = torch.full((rows.shape[0],), float("-inf"), dtype=acc, device=rows.device)
    for i0 in range(0, rows.shape[0], tile):
        running = out[i0 : i0 + tile]
        for j0 in range(0, cols.shape[0], tile):
            logits = (rows[i0 : i0 + tile] @ cols[j0 : j0 + tile].T).to(acc) * scale.to(acc)
            running = torch.logaddexp(running, torch.logsumexp(logits, dim=1))
        out[i0 : i0 + tile] = running
    return out


def block_grads(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    lse: torch.Tensor,
    tile: int,
    weight: torch.Tensor,
    diagonal: bool,
    d_rows: torch.Tensor | None = None,
    d_cols: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``weight * sum_i (lse_i - [diagonal] logits_ii)`` over this block.

    With ``P = exp(scale * rows @ cols^T - lse[:, None])`` and ``G = weight * (P - I_diag)``:
    returns ``d_rows = scale * G @ cols  [m, c]``, ``d_cols = scale * G^T @ rows  [n, c]`` and
    ``d_scale = sum(G * rows @ cols^T)  []``, all in the accumulation dtype. ``lse [m]`` is the
    row log-sum-exp over *all* columns (every block), so P is the global softmax restricted to
    this block. ``diagonal`` marks the block holding the positives (row i pairs with column i).
    Tiles are recomputed, never stored. ``d_rows``/``d_cols``, when given, are accumulated into
    (in place, accumulation dtype) instead of allocating new buffers.
    """
    acc = accumulation_dtype(rows.dtype)
    scale_acc, weight = scale.to(acc), weight.to(acc)
    if d_rows is None:
        d_rows = torch.zeros(rows.shape, dtype=acc, device=rows.device)
    if d_cols is None:
        d_cols = torch.zeros(cols.shape, dtype=acc, device=rows.device)
    d_scale = torch.zeros((), dtype=acc, device=rows.device)
    for i0 in range(0, rows.shape[0], tile):
        row_tile = rows[i0 : i0 + tile].to(acc)
        for j0 in range(0, cols.shape[0], tile):
            col_tile = cols[j0 : j0 + tile].to(acc)
            dots = row_tile @ col_tile.T
            grad = torch.exp(dots * scale_acc - lse[i0 : i0 + tile, None]) * weight
            if diagonal and i0 < j0 + col_tile.shape[0] and j0 < i0 + row_tile.shape[0]:
                index = torch.arange(max(i0, j0), min(i0 + row_tile.shape[0], j0 + col_tile.shape[0]),
                                     device=rows.device)
                grad[index - i0, index - j0] -= weight
            d_rows[i0 : i0 + tile] += scale_acc * (grad @ col_tile)
            d_cols[j0 : j0 + tile] += scale_acc * (grad.T @ row_tile)
            d_scale += (grad * dots).sum()
    return d_rows, d_cols, d_scale
