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
@pytest.mark.parametrize("m, n, c, diagonal", [(37, 37, 24, True), (50, 29, 40, False), (17, 70, 130, False),
                                                (48, 48, 24, True), (32, 64, 40, False)])  # whole tiles: EVEN
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


def test_the_kernels_log2_1p_is_within_a_few_ulps_of_float64_over_its_whole_range():
    """``_log2_1p`` (the sigmoid kernel's softplus tail, a polynomial on the FMA units in place of libdevice's log2f)
    against float64's ``log1p(e) / ln 2``, relatively, at e = 0, the smallest normal number, 2^-k for every k, and a
    dense grid of [0, 1]: a wrong coefficient or a dropped term is off by far more than 4 ulps. (A subnormal e, a
    logit 126 binary orders past the bias, is as exact as its value's few bits; the GPU's exp2 flushes it to 0.)"""
    import triton
    import triton.language as tl

    @triton.jit
    def evaluate(e_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(e_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, triton_tiles._log2_1p(e), mask=offs < n)

    special = torch.tensor([0.0, 1.0, torch.finfo(torch.float32).tiny] + [2.0**-k for k in range(1, 127)])
    e = torch.cat([special, torch.linspace(0, 1, 20001)]).float()
    out = torch.empty_like(e, device="cuda" if torch.cuda.is_available() else "cpu")
    evaluate[(triton.cdiv(e.numel(), 1024),)](e.to(out.device), out, e.numel(), BLOCK=1024)
    out = out.cpu()
    exact = torch.log1p(e.double()) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    relative = ((out.double() - exact).abs() / exact.clamp_min(1e-300))[e > 0]
    assert float(out[0]) == 0.0
    assert float(relative.max()) <= 4 * 2.0**-24, float(relative.max())


@pytest.mark.parametrize("width", [16, 128, 256])
def test_the_kernels_row_sums_of_log2_1p_match_float64(width):
    """``_log2_1p_sum`` (the sigmoid loss's tail summed over a tile's row as the logarithm of the row's product of
    ``1 + e``, held less one) against float64's ``sum(log1p(e)) / ln 2``, relatively, on rows of random, tiny (SigLIP's
    off-diagonal terms), mixed and empty values, and rows of ones: at 128 columns and more their product passes
    fp32's largest number, which must read as the sum (128 a part), not ``inf``; wider rows are summed in two parts.
    A product of rounded ``1 + e`` loses the tiny rows' bits, a plain ``a + b`` in place of the product is off by far
    more, and so is a wrong exponent or mantissa read from the bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def evaluate(e_ptr, out_ptr, ROWS: tl.constexpr, WIDTH: tl.constexpr):
        offs = tl.arange(0, ROWS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
        tl.store(out_ptr + tl.arange(0, ROWS), triton_tiles._log2_1p_sum(tl.load(e_ptr + offs), ROWS, WIDTH))

    generator = torch.Generator().manual_seed(width)
    uniform = torch.rand(4, width, generator=generator, dtype=torch.float64)
    tiny = 2.0 ** (-24 * torch.rand(4, width, generator=generator, dtype=torch.float64) - 8)  # 2^-32 .. 2^-8
    mixed = torch.where(torch.rand(4, width, generator=generator) < 0.1, uniform, tiny * 1e-3)
    ones = torch.ones(2, width, dtype=torch.float64)
    nearly = 1 - 2.0 ** -20 * torch.rand(2, width, generator=generator, dtype=torch.float64)
    e = torch.cat([uniform, tiny, mixed, ones, nearly, torch.zeros(1, width, dtype=torch.float64),
                   uniform[:1] * (torch.arange(width) % 2)]).float()
    rows = 1 << (e.shape[0] - 1).bit_length()  # a power of two, as tl.arange wants
    e = torch.cat([e, torch.zeros(rows - e.shape[0], width)])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(rows, device=device)
    evaluate[(1,)](e.to(device), out, ROWS=rows, WIDTH=width)
    out = out.cpu().double()
    exact = torch.log1p(e.double()).sum(1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert torch.isfinite(out).all()
    assert float(out[exact == 0].abs().max()) == 0.0
    relative = (out - exact).abs()[exact > 0] / exact[exact > 0]
    assert float(relative.max()) <= 2 * width * 2.0**-24, float(relative.max())
