"""Plain-torch reference of the tiled symmetric contrastive loss on one block of the matrix.

A block is ``rows [m, c]`` against ``cols [n, c]`` with logits ``S = scale * rows @ cols^T``. Rows
are one modality (images), columns the other (texts); the row log-sum-exps give the image->text
loss and the column log-sum-exps the text->image loss. Both functions walk the block in
``tile x tile`` pieces, so no more than one tile of logits exists at a time. Accumulation is in
fp32 (float64 for float64 inputs). ``triton_tiles.py`` implements the same math in Triton kernels
behind the same signatures; the tests hold both to float64.
"""

from __future__ import annotations

import contextlib

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def fp32_matmul(precision: str):
    """cuBLAS fp32 matmuls in ``tf32`` or exact ``ieee`` inside the block (restored after)."""
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"fp32 matmul precision {precision!r}: use tf32 or ieee")
    matmul = torch.backends.cuda.matmul
    # restore the exact previous setting: torch >= 2.9 keeps it as fp32_precision ("none", "tf32",
    # "ieee"), and allow_tf32 = False after True leaves "ieee", not the "none" it was; compiled
    # towers guard on this state and would recompile after every loss
    key = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    previous = getattr(matmul, key)
    setattr(matmul, key, precision if key == "fp32_precision" else precision == "tf32")
    try:
        yield
    finally:
        setattr(matmul, key, previous)


def block_stats(
    rows: torch.Tensor, cols: torch.Tensor, scale: torch.Tensor, tile: int = 4096,
    fp32_precision: str = "tf32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column ``logsumexp`` of ``scale * rows @ cols^T``: ``([m], [n])``, accumulation dtype.

    Tiles are merged with an online log-sum-exp (``logaddexp`` shifts by the maximum), so no
    partial ever overflows or underflows, whatever the scale.
    """
    acc = accumulation_dtype(rows.dtype)
    row_lse = torch.full((rows.shape[0],), float("-inf"), dtype=acc, device=rows.device)
    col_lse = torch.full((cols.shape[0],), float("-inf"), dtype=acc, device=rows.device)
    with fp32_matmul(fp32_precision):
        for i0 in range(0, rows.shape[0], tile):
            for j0 in range(0, cols.shape[0], tile):
                # in the accumulation dtype, as block_grads recomputes them: probabilities taken against
                # these log-sum-exps must come from the same logits, or they do not sum to one
                logits = (rows[i0 : i0 + tile].to(acc) @ cols[j0 : j0 + tile].to(acc).T) * scale.to(acc)
                row_lse[i0 : i0 + tile] = torch.logaddexp(row_lse[i0 : i0 + tile], torch.logsumexp(logits, 1))
                col_lse[j0 : j0 + tile] = torch.logaddexp(col_lse[j0 : j0 + tile], torch.logsumexp(logits, 0))
    return row_lse, col_lse


def block_grads(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    row_lse: torch.Tensor,
    col_lse: torch.Tensor,
    weight: torch.Tensor,
    diagonal: bool,
    d_rows: torch.Tensor | None = None,
    d_cols: torch.Tensor | None = None,
    tile: int = 4096,
    fp32_precision: str = "tf32",
    rows_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``weight * (sum_i row_lse_i + sum_j col_lse_j - 2 [diagonal] sum_i S_ii)``.

    ``row_lse [m]`` and ``col_lse [n]`` are the log-sum-exps over the *whole* matrix (every block),
    so ``P_row = exp(S - row_lse[:, None])`` and ``P_col = exp(S - col_lse[None, :])`` are the
    global softmaxes restricted to this block. With ``G = weight * (P_row + P_col - 2 I_diag)``:
    returns ``d_rows = scale * G @ cols [m, c]``, ``d_cols = scale * G^T @ rows [n, c]`` and
    ``d_scale = sum(G * rows @ cols^T) []``, in the accumulation dtype. ``diagonal`` marks the
    block holding the positives (row i pairs with column i). Tiles are recomputed, never stored.
    ``d_rows`` / ``d_cols``, when given, are accumulated into in place. ``rows_dtype`` (with
    ``d_rows`` None): the dtype of the returned ``d_rows``.
    """
    acc = accumulation_dtype(rows.dtype)
    scale_acc, weight = scale.to(acc), weight.to(acc)
    if d_rows is None:
        d_rows = torch.zeros(rows.shape, dtype=acc, device=rows.device)
    if d_cols is None:
        d_cols = torch.zeros(cols.shape, dtype=acc, device=rows.device)
    d_scale = torch.zeros((), dtype=acc, device=rows.device)
    with fp32_matmul(fp32_precision):
        for i0 in range(0, rows.shape[0], tile):
            row_tile = rows[i0 : i0 + tile].to(acc)
            for j0 in range(0, cols.shape[0], tile):
                col_tile = cols[j0 : j0 + tile].to(acc)
                dots = row_tile @ col_tile.T
                logits = dots * scale_acc
                grad = torch.exp(logits - row_lse[i0 : i0 + tile, None])
                grad += torch.exp(logits - col_lse[None, j0 : j0 + tile])
                if diagonal and i0 < j0 + col_tile.shape[0] and j0 < i0 + row_tile.shape[0]:
                    index = torch.arange(max(i0, j0), min(i0 + row_tile.shape[0], j0 + col_tile.shape[0]),
                                         device=rows.device)
                    grad[index - i0, index - j0] -= 2
                grad *= weight
                d_rows[i0 : i0 + tile] += scale_acc * (grad @ col_tile)
                d_cols[j0 : j0 + tile] += scale_acc * (grad.T @ row_tile)
                d_scale += (grad * dots).sum()
    if rows_dtype is not None:
        d_rows = d_rows.to(rows_dtype)
    return d_rows, d_cols, d_scale


def sigmoid_block(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    diagonal: bool,
    d_rows: torch.Tensor | None = None,
    d_cols: torch.Tensor | None = None,
    tile: int = 4096,
    fp32_precision: str = "tf32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sigmoid (SigLIP) loss of one block and, in the same pass, its gradients.

    With logits ``l = scale * rows @ cols^T + bias`` and ``z = +1`` on the diagonal of a
    ``diagonal`` block (row i pairs with column i), ``-1`` elsewhere, each logit contributes
    ``softplus(-z l) = -log sigmoid(z l)``, whose derivative is ``g = -z sigmoid(-z l)``. Returns
    ``(sum softplus(-z l), sum g * rows @ cols^T, sum g)`` in the accumulation dtype: the loss sum
    and the gradients of that sum w.r.t. ``scale`` and ``bias``. When ``d_rows [m, c]`` /
    ``d_cols [n, c]`` (accumulation dtype) are given, ``scale * g @ cols`` and ``scale * g^T @ rows``
    are added into them in place. No log-sum-exp: every logit's term is independent, so each tile
    is read once, for the loss and both gradients.
    """
    acc = accumulation_dtype(rows.dtype)
    scale_acc, bias_acc = scale.to(acc), bias.to(acc)
    loss = torch.zeros((), dtype=acc, device=rows.device)
    d_scale, d_bias = torch.zeros_like(loss), torch.zeros_like(loss)
    with fp32_matmul(fp32_precision):
        for i0 in range(0, rows.shape[0], tile):
            row_tile = rows[i0 : i0 + tile].to(acc)
            for j0 in range(0, cols.shape[0], tile):
                col_tile = cols[j0 : j0 + tile].to(acc)
                dots = row_tile @ col_tile.T
                minus_z = torch.ones_like(dots)  # -z: +1 off the diagonal
                if diagonal and i0 < j0 + col_tile.shape[0] and j0 < i0 + row_tile.shape[0]:
                    index = torch.arange(max(i0, j0), min(i0 + row_tile.shape[0], j0 + col_tile.shape[0]),
                                         device=rows.device)
                    minus_z[index - i0, index - j0] = -1.0
                margin = minus_z * (dots * scale_acc + bias_acc)  # -z l
                loss += torch.nn.functional.softplus(margin).sum()
                grad = minus_z * torch.sigmoid(margin)  # d softplus(-z l) / d l
                d_scale += (grad * dots).sum()
                d_bias += grad.sum()
                if d_rows is not None:
                    d_rows[i0 : i0 + tile] += scale_acc * (grad @ col_tile)
                if d_cols is not None:
                    d_cols[j0 : j0 + tile] += scale_acc * (grad.T @ row_tile)
    return loss, d_scale, d_bias
