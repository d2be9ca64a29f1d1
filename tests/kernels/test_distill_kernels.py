"""The distillation term's fused kernel (``triton_tiles.distill_block``, given the student's and the teacher's
log-sum-exps from ``distill_stats``, ``block_stats``' of each) against a float64 dense reference: the teacher-weighted
student logits summed over the rows and the columns, and the gradients of the rows' and columns' cross-entropies in both
feature sets and the scale, with and without the contrastive loss's weight, on ragged shapes, a teacher wider than the
student, large logits, and every input dtype (CPU: through TRITON_INTERPRET=1)."""

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


def reference(rows, cols, t_rows, t_cols, scale: float, t_scale: float, weight: float, contrastive_weight: float = 0.0,
              offset: int = 0):
    """float64, dense: ``(cross, d_rows, d_cols, d_scale, size)`` of ``weight`` x the rows' and columns'
    distillation cross-entropies plus ``contrastive_weight`` x the contrastive loss's sums (row ``i``'s positive in
    column ``i + offset``); ``size``: the cross sum's terms' magnitudes summed (logits of either sign cancel in the
    sum, not in its rounding)."""
    r, k = rows.double().requires_grad_(), cols.double().requires_grad_()
    s_ref = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    student = s_ref * r @ k.T
    teacher = t_scale * t_rows.double() @ t_cols.double().T
    cross = (teacher.softmax(1) * student).sum() + (teacher.softmax(0) * student).sum()
    lse = student.logsumexp(1).sum() + student.logsumexp(0).sum()
    positives = student[torch.arange(rows.shape[0]), torch.arange(rows.shape[0]) + offset].sum() \
        if contrastive_weight else 0.0
    (weight * (lse - cross) + contrastive_weight * (lse - 2 * positives)).backward()
    size = (teacher.softmax(1) * student.abs()).sum() + (teacher.softmax(0) * student.abs()).sum()
    return cross.detach(), r.grad, k.grad, s_ref.grad, size.detach()


def close(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    return float((got.cpu().double() - expected).norm() / expected.norm()) <= tolerance


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m, n, c, ct, scale, t_scale", [(37, 37, 24, 40, 14.0, 23.0), (50, 29, 40, 24, 100.0, 100.0),
                                                         (17, 70, 130, 33, 30.0, 5.0),
                                                         (48, 32, 24, 40, 14.0, 23.0),  # whole tiles: EVEN
                                                         # a teacher as wide as the student
                                                         (37, 45, 40, 40, 30.0, 20.0), (48, 32, 24, 24, 14.0, 23.0)])
def test_distill_block_matches_the_float64_reference(case, m, n, c, ct, scale, t_scale, monkeypatch):
    dtype, precision, tolerance = CASES[case]
    # fp32 rounds a logit of magnitude ~scale to scale x 2^-24, and every probability exp(S - lse) carries that as a
    # relative error, the student's and the teacher's alike, and G = P(S) - P(T) their difference: the bound grows with
    # the scales, 4 x 2^-24 a unit of the larger (exact fp32 dots, interpreted: the gradients' error 2.2e-6 at 14 and
    # 23, where the two log-sum-exps' rounding leans opposite ways, 5.5e-7 where it leans alike; CASES' 2e-6 failed at
    # 100 on an H200)
    tolerance = max(tolerance, 4 * max(scale, t_scale) * 2.0**-24)
    rows, cols, t_rows, t_cols = (x.to(dtype) for x in inputs(m, n, c, ct, seed=m + n + c))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # stripes of a few columns: the column statistics merged stripe by stripe, as at 1M on a GPU
        monkeypatch.setattr(triton_tiles, "PARTIAL_BYTES", 20 * 16 * triton_tiles.triton.cdiv(m, 16) * 2)
    weight = 0.37
    cross_ref, d_rows_ref, d_cols_ref, d_scale_ref, size = reference(rows, cols, t_rows, t_cols, scale, t_scale,
                                                                     weight)

    on = [x.to(device) for x in (rows, cols, t_rows, t_cols)]
    scale_t = torch.tensor(scale, device=device)
    lse = triton_tiles.distill_stats(*on, scale_t, t_scale, precision)
    d_rows, d_cols = torch.zeros(m, c, device=device), torch.zeros(n, c, device=device)
    cross, d_scale = triton_tiles.distill_block(*on, scale_t, t_scale, *lse, weight, d_rows, d_cols,
                                                fp32_precision=precision)
    assert abs(float(cross) - float(cross_ref)) <= tolerance * float(size)
    assert close(d_rows, d_rows_ref, tolerance)
    assert close(d_cols, d_cols_ref, tolerance)
    assert abs(float(d_scale) / float(d_scale_ref) - 1) <= tolerance  # weight * sum(G * dots)
    # the value alone (no gradient wanted): the kernel writes no G, the same sum
    alone, no_scale = triton_tiles.distill_block(*on, scale_t, t_scale, *lse, fp32_precision=precision)
    assert abs(float(alone) - float(cross_ref)) <= tolerance * float(size) and float(no_scale) == 0.0


@pytest.mark.parametrize("offset", [0, 5])
def test_distill_block_takes_the_contrastive_losss_gradient_too(offset, monkeypatch):
    """With ``contrastive_weight`` one G carries both terms: the contrastive loss's positives on the diagonal moved by
    ``diagonal_offset`` (a rank's rows against every rank's columns), over blocks of G of one tile each."""
    from .test_tiles import small_blocks_of_g

    small_blocks_of_g(monkeypatch)
    m, n = 21, 29
    rows, cols, t_rows, t_cols = (x.float() for x in inputs(m, n, 24, 40, seed=3))
    cross, d_rows_ref, d_cols_ref, d_scale_ref, size = reference(rows, cols, t_rows, t_cols, 20.0, 10.0, 0.37, 0.21,
                                                                 offset)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on = [x.to(device) for x in (rows, cols, t_rows, t_cols)]
    scale = torch.tensor(20.0, device=device)
    d_rows, d_cols = torch.zeros(m, 24, device=device), torch.zeros(n, 24, device=device)
    lse = triton_tiles.distill_stats(*on, scale, 10.0, "ieee")
    got, d_scale = triton_tiles.distill_block(*on, scale, 10.0, *lse, 0.37, d_rows, d_cols, "ieee",
                                              contrastive_weight=0.21, diagonal_offset=offset)
    assert abs(float(got) - float(cross)) <= 2e-6 * float(size)
    assert close(d_rows, d_rows_ref, 2e-6) and close(d_cols, d_cols_ref, 2e-6)
    assert abs(float(d_scale) / float(d_scale_ref) - 1) <= 2e-6


def test_the_distilled_loss_runs_the_fused_kernels_where_they_apply(monkeypatch):
    """``loss.impl=triton`` (interpreted here) with one teacher takes the kernels, and on one process they give the
    contrastive loss too (its own kernels do not run): the student's and the teacher's statistics, then one pass for
    the term's value and both gradients, in the forward; an ensemble takes the torch blocks. Without a gradient
    wanted, the same value from a pass that writes no G."""
    from megabatch.losses import InfClLoss
    from megabatch.losses.distill import DistilledLoss

    calls = []
    for name in ("distill_stats", "distill_block", "block_stats", "block_grads"):
        original = getattr(triton_tiles, name)
        monkeypatch.setattr(triton_tiles, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, cols, t_rows, t_cols = (x.float().to(device) for x in inputs(9, 9, 16, 24, seed=1))
    scale = torch.tensor(10.0, device=device)
    loss = DistilledLoss(InfClLoss(impl="triton", fp32_precision="ieee"), 1.0, 20.0)
    images = rows.clone().requires_grad_()
    value = loss(images, cols, scale, teacher=(t_rows, t_cols))
    both = ["distill_stats", "block_stats", "block_stats", "distill_block"]  # the student's, the teacher's, the pass
    assert calls == both  # both terms, both directions
    value.backward()
    assert calls == both  # the backward scales what the forward made
    with torch.no_grad():
        again = loss(images, cols, scale, teacher=(t_rows, t_cols))
    torch.testing.assert_close(again, value.detach(), rtol=1e-6, atol=0)
    calls.clear()
    ensemble = (torch.stack([t_rows, t_rows], 1), torch.stack([t_cols, t_cols], 1))
    DistilledLoss(InfClLoss(impl="triton", fp32_precision="ieee"), 1.0, (20.0, 10.0))(
        images, cols, scale, teacher=ensemble).backward()
    assert calls == ["block_stats", "block_grads"]  # the contrastive loss's own kernels, the term in torch
