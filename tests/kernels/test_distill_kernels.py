"""The distillation term's fused kernels (``triton_tiles.distill_stats``/``distill_grads``) against a float64
dense reference: per row and per column the student's and the teacher's log-sum-exp and the teacher-weighted
student logits, and the gradients of the rows' and columns' cross-entropies in both feature sets and the scale
(columns merged over stripes), on ragged shapes, a teacher
wider than the student, large logits, and every input dtype (CPU: through TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels import triton_tiles

from .test_tiles import CASES


def inputs(m: int, n: int, c: int, ct: int, seed: int):
    generator = torch.Generator().manual_seed(seed)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1)

    rows, cols = unit(m, c), unit(n, c)
    t_rows = unit(m, ct)
    t_cols = F.normalize(torch.cat([t_rows, unit(max(0, n - m), ct)])[:n] + 0.7 * unit(n, ct), dim=-1)
    return rows, cols, t_rows, t_cols


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m, n, c, ct, scale, t_scale", [(37, 37, 24, 40, 14.0, 23.0), (50, 29, 40, 24, 100.0, 100.0),
                                                         (17, 70, 130, 33, 30.0, 5.0),
                                                         (48, 32, 24, 40, 14.0, 23.0)])  # whole tiles: EVEN
@pytest.mark.parametrize("shared", ["1", "0"])
def test_distill_stats_and_grads_match_the_float64_reference(case, m, n, c, ct, scale, t_scale, shared, monkeypatch):
    monkeypatch.setattr(triton_tiles, "SHARED_SHIFT", shared)  # a whole tile within the spread by one shift, or not
    dtype, precision, tolerance = CASES[case]
    # fp32 rounds a logit of magnitude ~scale to scale x 2^-24, and every probability exp(S - lse) carries that as a
    # relative error: the bound grows with the scale (exact fp32 dots, three tile configs, interpreted: the gradients'
    # error 1.96-2.15e-6 at scale 100, 3-6e-7 at 14 and 30; CASES' 2e-6 failed at 100 on an H200)
    tolerance *= max(1.0, max(scale, t_scale) / 50)
    rows, cols, t_rows, t_cols = (x.to(dtype) for x in inputs(m, n, c, ct, seed=m + n + c))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # stripes of a few columns: the column fields merged stripe by stripe, as at 1M on a GPU
        monkeypatch.setattr(triton_tiles, "PARTIAL_BYTES", 20 * 16 * triton_tiles.triton.cdiv(m, 16) * 2)
    # the reference: dense logits in float64 from the same rounded inputs, both directions
    r, k = rows.double().requires_grad_(), cols.double().requires_grad_()
    s_ref = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    student = s_ref * r @ k.T
    teacher = t_scale * t_rows.double() @ t_cols.double().T
    by_rows = (student.logsumexp(1), teacher.logsumexp(1), (teacher.softmax(1) * student).sum(1))
    by_cols = (student.logsumexp(0), teacher.logsumexp(0), (teacher.softmax(0) * student).sum(0))
    weight = 0.37
    (weight * ((by_rows[0] - by_rows[2]).sum() + (by_cols[0] - by_cols[2]).sum())).backward()

    on = [x.to(device) for x in (rows, cols, t_rows, t_cols)]
    scale_t = torch.tensor(scale, device=device)
    row_stats, col_stats = triton_tiles.distill_stats(*on, scale_t, t_scale, fp32_precision=precision)
    for direction, got, expected in (("rows", row_stats, by_rows), ("columns", col_stats, by_cols)):
        for name, value, reference in zip(("student lse", "teacher lse", "cross"), got, expected, strict=True):
            reference = reference.detach()
            assert (value.cpu().double() - reference).norm() / reference.norm() <= tolerance, f"{direction} {name}"
    d_rows, d_cols = torch.zeros(m, c, device=device), torch.zeros(n, c, device=device)
    d_scale = triton_tiles.distill_grads(*on, scale_t, t_scale, row_stats[:2], col_stats[:2],
                                         torch.tensor(weight, device=device), d_rows, d_cols,
                                         fp32_precision=precision)
    assert (d_rows.cpu().double() - r.grad).norm() / r.grad.norm() <= tolerance
    assert (d_cols.cpu().double() - k.grad).norm() / k.grad.norm() <= tolerance
    # the scale's gradient: weight * sum(G * dots)
    assert abs(float(d_scale) / float(s_ref.grad) - 1) <= tolerance


def test_the_distilled_loss_runs_the_fused_kernels_where_they_apply(monkeypatch):
    """``loss.impl=triton`` (interpreted here) with one teacher takes the kernels, and on one process they give the
    contrastive loss too (its own kernels do not run); an ensemble takes the torch blocks."""
    from megabatch.losses import InfClLoss
    from megabatch.losses.distill import DistilledLoss

    calls = []
    for name in ("distill_stats", "distill_grads", "block_stats", "block_grads"):
        original = getattr(triton_tiles, name)
        monkeypatch.setattr(triton_tiles, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, cols, t_rows, t_cols = (x.float().to(device) for x in inputs(9, 9, 16, 24, seed=1))
    scale = torch.tensor(10.0, device=device)
    loss = DistilledLoss(InfClLoss(impl="triton", fp32_precision="ieee"), 1.0, 20.0)
    images = rows.clone().requires_grad_()
    loss(images, cols, scale, teacher=(t_rows, t_cols)).backward()
    assert calls == ["distill_stats", "distill_grads"]  # both terms, both directions, in one call each
    calls.clear()
    ensemble = (torch.stack([t_rows, t_rows], 1), torch.stack([t_cols, t_cols], 1))
    DistilledLoss(InfClLoss(impl="triton", fp32_precision="ieee"), 1.0, (20.0, 10.0))(
        images, cols, scale, teacher=ensemble).backward()
    assert calls == ["block_stats", "block_grads"]  # the contrastive loss's own kernels, the term in torch


def test_one_exponential_a_logit_only_where_the_tile_allows(monkeypatch):
    """The statistics kernel takes one exponential a logit of each matrix in a whole tile whose logits span at most
    ``SHARED_SHIFT_SPREAD`` (log2 units), else each row's and column's own shift. ``test_tiles.wide_tiles``' columns
    at cos -0.5 from every row (student and teacher alike) span 216 beside the others at scale 100: their statistics
    match float64 with the shipped limit, and come out wrong with it lifted (one shift for the tile underflows
    them)."""
    from .test_tiles import interpreter_tiles, wide_tiles

    rows, cols = (x.double().cpu() for x in wide_tiles(torch.float32))
    teacher = 100.0 * rows @ cols.T
    expected = (teacher.logsumexp(0), teacher.logsumexp(0), (teacher.softmax(0) * teacher).sum(0))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on = [x.float().to(device) for x in (rows, cols, rows, cols)]
    monkeypatch.setattr(triton_tiles, "SHARED_SHIFT", "1")  # on a GPU too
    interpreter_tiles(monkeypatch)  # whole tiles of the 32 x 32 block, which alone take the shared shift

    def column_errors():
        _, col_stats = triton_tiles.distill_stats(*on, torch.tensor(100.0, device=device), 100.0,
                                                  fp32_precision="ieee")
        return [float((got.cpu().double() - want).abs().max() / want.abs().max())
                for got, want in zip(col_stats, expected, strict=True)]

    assert max(column_errors()) < 1e-5
    monkeypatch.setattr(triton_tiles, "SHARED_SHIFT_SPREAD", 1e9)
    assert max(column_errors()) > 1e-2
