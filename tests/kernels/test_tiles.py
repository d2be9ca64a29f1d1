"""The tile functions, Triton kernels and plain-torch reference, against float64 math.

Inputs are rounded to the dtype under test first; the float64 reference is computed from those
rounded inputs, so what is measured is the error of the computation, not of the rounding. On a
CPU the Triton kernels run through ``TRITON_INTERPRET=1`` (set in conftest); on a GPU the same
tests run the compiled kernels (with TF32 for fp32 inputs where the case asks for it).

Pass rule (Cut Cross-Entropy's): the error of an implementation is at most the error of a baseline
plus a tolerance per dtype. The Triton kernels' baseline is the tiled torch reference; the torch
reference's is dense plain torch in the same dtype, as autocast computes it (``dense_in_dtype``):
- fp32 (exact ``ieee`` dots): 2e-6. Every step is fp32; the errors are a few ulps (2^-24 = 6e-8)
  grown by sums over the tile lengths.
- fp32 with TF32 dots: 1e-3 (TF32 keeps 10 mantissa bits: 2^-11 = 5e-4 per product).
- fp16: 1e-3. The kernels store the softmax-gradient stripe G' in fp16 (2^-11 relative per
  element, scaled by 2^14 so small probabilities stay normal numbers) before the cuBLAS GEMMs.
- bf16: 5e-3. G' stored in bf16 rounds each element by up to 2^-9 = 2e-3 relative; the
  gradients returned to bf16 features are rounded by as much again when cast back.
Log-sum-exps are compared in absolute terms (they are O(scale) numbers): error / scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels import torch_tiles, triton_tiles

from ..helpers import rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = {"torch": torch_tiles, "triton": triton_tiles}
# (dtype, fp32 precision, tolerance)
CASES = {
    "fp32": (torch.float32, "ieee", 2e-6),
    "tf32": (torch.float32, "tf32", 1e-3),
    "fp16": (torch.float16, "tf32", 1e-3),
    "bf16": (torch.bfloat16, "tf32", 5e-3),
}
if DEVICE == "cpu":  # the interpreter and the CPU have no TF32: the case would repeat "fp32"
    del CASES["tf32"]


def features(m: int, n: int, c: int, seed: int, diagonal: bool, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    rows = F.normalize(torch.randn(m, c, generator=generator, dtype=torch.float64), dim=-1)
    cols = torch.randn(n, c, generator=generator, dtype=torch.float64)
    if diagonal:  # positives correlated with their rows, as in a trained model
        cols = rows + 0.8 * cols
    cols = F.normalize(cols, dim=-1)
    return rows.to(dtype).to(DEVICE), cols.to(dtype).to(DEVICE)


def dense(rows, cols, scale: float, weight: float, diagonal: bool, dtype: torch.dtype, stats: torch.dtype):
    """The whole logits matrix from one GEMM in ``dtype``, its log-sum-exps in ``stats``, and autograd
    back through the same GEMM: row/column log-sum-exps and the gradients of the symmetric objective."""
    rows_, cols_ = (x.detach().to(dtype).requires_grad_() for x in (rows, cols))
    scale_ = torch.tensor(scale, dtype=stats, device=rows.device, requires_grad=True)
    logits = scale_ * (rows_ @ cols_.T).to(stats)
    row_lse, col_lse = torch.logsumexp(logits, 1), torch.logsumexp(logits, 0)
    objective = row_lse.sum() + col_lse.sum()
    if diagonal:
        objective = objective - 2 * logits.diagonal().sum()
    (weight * objective).backward()
    return row_lse.detach(), col_lse.detach(), rows_.grad, cols_.grad, scale_.grad


def dense_reference(rows, cols, scale: float, weight: float, diagonal: bool):
    """float64 throughout: the reference every implementation is measured against."""
    return dense(rows, cols, scale, weight, diagonal, torch.float64, torch.float64)


def dense_in_dtype(rows, cols, scale: float, weight: float, diagonal: bool, precision: str):
    """Plain torch as autocast runs it, the baseline of the tiled torch reference: the logits GEMM in
    the features' dtype, the log-sum-exps in fp32, autograd back through the same GEMMs (their output
    gradient cast back to the features' dtype)."""
    with torch_tiles.fp32_matmul(precision):
        return dense(rows, cols, scale, weight, diagonal, rows.dtype, torch.float32)


def tiling(module) -> dict:
    """The torch reference walks ``tile``-sized pieces (16: ragged against these shapes); the
    Triton kernels size their own tiles and take no such argument."""
    return {"tile": 16} if module is torch_tiles else {}


def run(module, rows, cols, scale: float, weight: float, diagonal: bool, precision: str):
    scale_t = torch.tensor(scale, device=rows.device)
    row_lse, col_lse = module.block_stats(rows, cols, scale_t, **tiling(module), fp32_precision=precision)
    grads = module.block_grads(rows, cols, scale_t, row_lse, col_lse, torch.tensor(weight, device=rows.device),
                               diagonal, **tiling(module), fp32_precision=precision)
    return (row_lse, col_lse, *grads)


def errors(results, reference, scale: float, weight: float) -> dict:
    row_lse, col_lse, d_rows, d_cols, d_scale = results
    for name, value in zip(("row_lse", "col_lse", "d_rows", "d_cols", "d_scale"), results, strict=True):
        assert torch.isfinite(value).all(), f"{name} has NaN/Inf"
    return {
        "row_lse": float((row_lse.double() - reference[0]).abs().max()) / scale,
        "col_lse": float((col_lse.double() - reference[1]).abs().max()) / scale,
        "d_rows": rel_error(d_rows, reference[2]),
        "d_cols": rel_error(d_cols, reference[3]),
        # d_scale = weight * sum(G * dots) with |dots| <= 1 and |G| summing to at most 2 (m + n):
        # its error is measured against that mass (the sum itself may cancel to near zero)
        "d_scale": float((d_scale.double() - reference[4]).abs()) / (weight * 2 * (len(row_lse) + len(col_lse))),
    }


def check_against_torch(impl: str, case: str, m: int, n: int, c: int, scale: float, diagonal: bool,
                        seed: int = 0, rows=None, cols=None, tolerance: float | None = None):
    dtype, precision, case_tolerance = CASES[case]
    tolerance = case_tolerance if tolerance is None else tolerance
    if rows is None:
        rows, cols = features(m, n, c, seed, diagonal, dtype)
    weight = 1.0 / (2 * rows.shape[0])
    reference = dense_reference(rows, cols, scale, weight, diagonal)
    got = errors(run(IMPLS[impl], rows, cols, scale, weight, diagonal, precision), reference, scale, weight)
    # the Triton kernels against the tiled torch reference; that reference against dense plain torch in
    # the same dtype (an independent computation it can lose to)
    plain = run(torch_tiles, rows, cols, scale, weight, diagonal, precision) if impl != "torch" \
        else dense_in_dtype(rows, cols, scale, weight, diagonal, precision)
    baseline = errors(plain, reference, scale, weight)
    for key, error in got.items():
        assert error <= baseline[key] + tolerance, (
            f"{impl} {case} {m}x{n}x{c} scale={scale}: {key} error {error:.3g} > torch's "
            f"{baseline[key]:.3g} + {tolerance:g}"
        )
    return got


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize(("m", "n", "c", "diagonal"), [(67, 45, 48, False), (67, 67, 40, True), (48, 64, 40, False)])
@pytest.mark.parametrize("scale", [1.0, 100.0])
@pytest.mark.parametrize("shared", ["1", "checked", "0"])
def test_matches_float64(impl, case, m, n, c, diagonal, scale, shared, monkeypatch):
    """Every tile shifted by its own maxima, or a whole tile within the spread by one shift (``1``: a branch a
    tile; ``checked``: every tile, the programs with a tile past the limit redone); ragged blocks (masked) and
    blocks of whole tiles (the interpreter's 16 x 16: the kernels' ``EVEN``, no mask)."""
    if impl == "torch" and shared != "1":
        pytest.skip("the torch reference has one way")
    monkeypatch.setattr(triton_tiles, "SHARED_SHIFT", shared)
    check_against_torch(impl, case, m, n, c, scale, diagonal)


@pytest.mark.parametrize("case", list(CASES))
def test_near_duplicates_and_opposites_at_scale_100(case):
    """Sharply peaked softmaxes and columns whose every logit is ~ -100: a fixed shift by the
    scale would underflow them (exp(-200) = 0 in fp32); per-column maxima must not."""
    dtype = CASES[case][0]
    generator = torch.Generator().manual_seed(3)
    base = F.normalize(torch.randn(3, 64, generator=generator, dtype=torch.float64), dim=-1)
    noise = 1e-3 * torch.randn(40, 64, generator=generator, dtype=torch.float64)
    rows = F.normalize(base.repeat(14, 1)[:40] + noise, dim=-1)  # 40 rows, near-duplicates of 3
    cols = F.normalize(torch.cat([rows[:20] + 1e-3 * noise[:20], -rows[20:]]), dim=-1)
    rows, cols = rows.to(dtype).to(DEVICE), cols.to(dtype).to(DEVICE)
    check_against_torch("triton", case, 0, 0, 0, 100.0, True, rows=rows, cols=cols)


def spread_tiles(dtype: torch.dtype):
    """32 rows against 32 columns (two 16 x 16 tiles a side, the interpreter's tiles) at scale 100, whose first tile's
    logits span 148.6 in log2 units, near the forward's limit for one exponential a logit (150): column 0 meets the
    first row block at cos -0.13 beside cos 0.9 in its other columns, and the second row block at cos -0.14, where
    nothing is much larger; that row block still holds 27% of the column's sum."""
    basis = torch.eye(64, dtype=torch.float64)
    generator = torch.Generator().manual_seed(5)
    rows = torch.cat([-0.13 * basis[0] + 0.9 * basis[1] + 0.42 * basis[2:18],
                      -0.14 * basis[0] + 0.99 * basis[18:34]])
    cols = torch.cat([basis[:1], F.normalize(basis[1] + 0.01 * torch.randn(15, 64, generator=generator), dim=-1),
                      F.normalize(torch.randn(16, 64, generator=generator, dtype=torch.float64), dim=-1)])
    return F.normalize(rows, dim=-1).to(dtype).to(DEVICE), cols.to(dtype).to(DEVICE)


@pytest.mark.parametrize("case", ["fp32", "bf16"])
@pytest.mark.parametrize("shared", ["1", "checked"])
def test_one_exponential_a_logit_near_its_limit(case, shared, monkeypatch):
    """The forward takes one exponential a logit in a tile whose logits span up to 150 (log2 units), shifted by
    the tile's largest (less 32) for rows and columns alike: a column whose share of a tile sits 148 below its
    largest, and whose other row block's tile is shifted ~129 lower, keeps both shares (float64 within the usual
    tolerance)."""
    monkeypatch.setattr(triton_tiles, "SHARED_SHIFT", shared)  # on a GPU too
    rows, cols = spread_tiles(CASES[case][0])
    check_against_torch("triton", case, 0, 0, 0, 100.0, False, rows=rows, cols=cols)


def wide_tiles(dtype: torch.dtype):
    """32 rows, all near one feature, against 32 columns: 8 near it (cos 1) and 24 at cos -0.5 from it. At scale 100
    a tile holding both kinds spans 216 in log2 units, past the limit for one exponential a logit (150); the
    columns at -0.5 have no larger logit anywhere, so their whole log-sum-exp comes from such tiles."""
    generator = torch.Generator().manual_seed(3)
    basis = torch.eye(64, dtype=torch.float64)
    rows = F.normalize(basis[0] + 1e-3 * torch.randn(32, 64, generator=generator, dtype=torch.float64), dim=-1)
    cols = torch.cat([F.normalize(basis[0] + 1e-3 * torch.randn(8, 64, generator=generator, dtype=torch.float64),
                                  dim=-1), -0.5 * basis[0] + 0.866 * basis[1:25]])
    return rows.to(dtype).to(DEVICE), F.normalize(cols, dim=-1).to(dtype).to(DEVICE)


@pytest.mark.parametrize("shared", ["1", "checked"])
def test_one_exponential_a_logit_only_where_the_tile_allows(shared, monkeypatch):
    """Where a tile's logits span more than the limit, the forward shifts each row and column by its own largest:
    with the limit lifted, one shift for the whole tile underflows the columns at cos -0.5 (every term 2^-185) and
    their log-sum-exps come out wrong, which the shipped limit keeps right."""
    rows, cols = wide_tiles(torch.float32)
    monkeypatch.setattr(triton_tiles, "SHARED_SHIFT", shared)  # on a GPU too
    interpreter_tiles(monkeypatch)  # whole tiles of the 32 x 32 block, where "1" takes the shared shift (a GPU's: one)
    # fp32 rounds a logit of ~100 to 100 x 2^-24 and every probability carries that relatively: at scale 100 the
    # bound doubles (on an H200 these sharply peaked rows' d_rows came 4.7e-6 from float64 against torch's 2.7e-6,
    # the same without the shared shift: every tile here is past its limit)
    tolerance = 2 * CASES["fp32"][2]
    check_against_torch("triton", "fp32", 0, 0, 0, 100.0, False, rows=rows, cols=cols, tolerance=tolerance)
    monkeypatch.setattr(triton_tiles, "SHARED_SHIFT_SPREAD", 1e9)
    with pytest.raises(AssertionError, match="col_lse error"):
        check_against_torch("triton", "fp32", 0, 0, 0, 100.0, False, rows=rows, cols=cols, tolerance=tolerance)


def test_tiles_that_reach_past_a_block_of_g_are_refused(monkeypatch):
    """The block kernels store G and sum G * dots without a mask: no tile may reach from one block into the next,
    so tiles that do not divide the blocks' alignment are refused before any launch."""
    monkeypatch.setattr(triton_tiles, "G_ALIGN", 8)
    rows, cols = features(20, 20, 16, 0, True, torch.float32)
    scale = torch.tensor(10.0, device=rows.device)
    lse = triton_tiles.block_stats(rows, cols, scale)
    with pytest.raises(ValueError, match="do not divide the blocks of G"):
        triton_tiles.block_grads(rows, cols, scale, *lse, torch.tensor(0.1, device=rows.device), True)


def interpreter_tiles(monkeypatch):
    """The interpreter's 16 x 16 tiles on a GPU too, in place of the tuned ones (a test's small blocks then hold whole
    tiles, as they do interpreted)."""
    monkeypatch.setattr(triton_tiles, "get_config", lambda *args, **kwargs: dict(triton_tiles.INTERPRET_CONFIG))


def small_blocks_of_g(monkeypatch):
    """G' in 16 x 16 blocks, with tiles that divide them (``interpreter_tiles``: the tuned ones would reach past such
    a block, which ``_g_blocks`` refuses)."""
    monkeypatch.setattr(triton_tiles, "G_BYTES", 16 * 16 * 4)
    monkeypatch.setattr(triton_tiles, "G_ALIGN", 16)
    interpreter_tiles(monkeypatch)


def test_stripes_and_splits_cover_the_block(monkeypatch):
    """Tiny memory budgets force many forward column stripes and backward blocks of G'."""
    monkeypatch.setattr(triton_tiles, "PARTIAL_BYTES", 8 * 5 * 16)  # 16-column stripes
    small_blocks_of_g(monkeypatch)
    check_against_torch("triton", "fp32", 67, 45, 48, 30.0, False)
    check_against_torch("triton", "fp32", 67, 67, 40, 30.0, True)


def test_the_blocks_of_g_take_their_size_from_the_environment():
    """``MEGABATCH_LOSS_G_MIB`` sets one backward block's memory (the sides it gives), and a value that is not a
    positive number of MiB stops the import with the variable's name and what it takes."""
    import os
    import subprocess
    import sys

    show = ("from megabatch.kernels import triton_tiles as t; import torch; b = 10**6; "
            "print(t.G_BYTES, t._block_sides(torch.float16, b, b), t._block_sides(torch.float32, b, b))")
    if "MEGABATCH_LOSS_G_MIB" not in os.environ:  # this process's module: the default
        assert triton_tiles.G_BYTES == 1152 * 2**20
        assert triton_tiles._block_sides(torch.float16, 10**6, 10**6) == (24576, 24576)
        assert triton_tiles._block_sides(torch.float32, 10**6, 10**6) == (17152, 17408)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    less = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=120,
                          env={**env, "MEGABATCH_LOSS_G_MIB": "768"})
    assert less.stdout.split() == [str(768 * 2**20), "(19968,", "19968)", "(14080,", "14080)"], less.stderr
    bad = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=120,
                         env={**env, "MEGABATCH_LOSS_G_MIB": "1.5G"})
    assert bad.returncode != 0 and "MEGABATCH_LOSS_G_MIB='1.5G'" in bad.stderr and "positive integer" in bad.stderr


def test_column_splits_cover_the_block(monkeypatch):
    """A GPU with many SMs splits each row block's columns over programs (merged afterwards)."""
    monkeypatch.setattr(triton_tiles, "_sms", lambda device: 64)
    check_against_torch("triton", "fp32", 67, 45, 48, 30.0, False)
    check_against_torch("triton", "bf16", 67, 67, 40, 100.0, True)


def spy_on_loads(monkeypatch) -> list[bool]:
    """Whether each launch loads its tiles (and each block kernel stores G) through tensor descriptors (TMA)."""
    seen, operands, g_target = [], triton_tiles._operands, triton_tiles._g_target

    def spy(a, b, config):
        out = operands(a, b, config)
        seen.append(out[2])
        return out

    def spy_g(g_block, config, tma):
        out = g_target(g_block, config, tma)
        seen.append(out[1])
        return out

    monkeypatch.setattr(triton_tiles, "_operands", spy)
    monkeypatch.setattr(triton_tiles, "_g_target", spy_g)
    return seen


@pytest.mark.parametrize("loads", ["tma", "per_thread"])
@pytest.mark.parametrize("sms", [1, 64])
def test_either_way_of_loading_tiles_with_any_number_of_programs(loads, sms, monkeypatch):
    """Tiles loaded through tensor descriptors (TMA: the default where the GPU and the layout allow) or by each
    thread, by two persistent programs that walk every tile of a block between them (one SM) or by one program a
    tile (64 SMs): each matches float64."""
    monkeypatch.setattr(triton_tiles, "TMA", "auto" if loads == "tma" else "0")
    monkeypatch.setattr(triton_tiles, "_sms", lambda device: sms)
    seen = spy_on_loads(monkeypatch)
    check_against_torch("triton", "bf16", 67, 67, 40, 30.0, True)
    check_against_torch("triton", "fp32", 67, 45, 48, 30.0, False)
    assert seen and all(tma == (loads == "tma") for tma in seen)


def test_a_layout_tma_cannot_load_takes_per_thread_loads(monkeypatch):
    """bf16 rows of 45 features (90 bytes: not 16-byte aligned) and a strided view: no descriptor, the same math."""
    seen = spy_on_loads(monkeypatch)
    check_against_torch("triton", "bf16", 40, 33, 45, 30.0, False)
    rows, cols = features(40, 33, 96, 0, False, torch.float32)
    check_against_torch("triton", "fp32", 0, 0, 0, 30.0, False, rows=rows[:, ::2], cols=cols[:, ::2])
    assert seen and not any(seen)


def test_the_sigmoid_and_distillation_kernels_either_way_of_loading(monkeypatch):
    """The same sums, gradients and statistics from tiles loaded through descriptors and by each thread."""
    rows, cols = features(67, 45, 48, 0, False, torch.float32)
    t_rows, t_cols = features(67, 45, 24, 1, False, torch.float32)
    scale, bias = torch.tensor(20.0, device=DEVICE), torch.tensor(-5.0, device=DEVICE)
    outs = {}
    for loads in ("auto", "0"):
        monkeypatch.setattr(triton_tiles, "TMA", loads)
        d_rows, d_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        sums = triton_tiles.sigmoid_block(rows, cols, scale, bias, False, d_rows, d_cols, "ieee")
        lse = triton_tiles.distill_stats(rows, cols, t_rows, t_cols, scale, 30.0, "ieee")
        t_rows_, t_cols_ = torch.zeros_like(rows), torch.zeros_like(cols)
        cross, d_scale = triton_tiles.distill_block(rows, cols, t_rows, t_cols, scale, 30.0, *lse, 0.5, t_rows_,
                                                    t_cols_, "ieee")
        outs[loads] = [*sums, d_rows, d_cols, *lse, cross, d_scale, t_rows_, t_cols_]
    for tma, per_thread in zip(outs["auto"], outs["0"], strict=True):
        torch.testing.assert_close(tma, per_thread, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("group", [1, 3, 64])
def test_any_tile_order_gives_the_same_gradients(group, monkeypatch):
    """The block kernels' tile order (``MEGABATCH_LOSS_GROUP_M`` row blocks walking the columns together: one, a group
    of 3 that leaves 2 over at 67 rows, or all) moves no logit's gradient, for the backward's, the sigmoid's and the
    distillation's kernels (the scale's partial sums only in their rounding)."""
    rows, cols = features(67, 45, 48, 0, False, torch.float32)
    t_rows, t_cols = features(67, 45, 24, 1, False, torch.float32)
    scale, bias = torch.tensor(20.0, device=DEVICE), torch.tensor(-5.0, device=DEVICE)
    monkeypatch.setattr(triton_tiles, "_sms", lambda device: 1)  # two programs walk every tile between them
    outs = {}
    for rows_together in (triton_tiles.GROUP_ROWS, group):
        monkeypatch.setattr(triton_tiles, "GROUP_ROWS", rows_together)
        lse = triton_tiles.block_stats(rows, cols, scale, "ieee")
        d_rows, d_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        d_scale = triton_tiles.block_grads(rows, cols, scale, *lse, torch.tensor(0.5), True, d_rows, d_cols, "ieee")[2]
        s_rows, s_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        sums = triton_tiles.sigmoid_block(rows, cols, scale, bias, False, s_rows, s_cols, "ieee")
        t_lse = triton_tiles.distill_stats(rows, cols, t_rows, t_cols, scale, 30.0, "ieee")
        k_rows, k_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        k_sums = triton_tiles.distill_block(rows, cols, t_rows, t_cols, scale, 30.0, *t_lse, 0.5, k_rows, k_cols,
                                            "ieee")
        outs[rows_together] = [d_rows, d_cols, s_rows, s_cols, k_rows, k_cols, d_scale, *sums, *k_sums]
    first, then = outs.values()
    for a, b in zip(first[:6], then[:6], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first[6:], then[6:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_tile_order_and_the_accumulator_flag_take_their_setting_from_the_environment():
    """``MEGABATCH_LOSS_GROUP_M`` (a positive integer) and ``MEGABATCH_LOSS_ACC_FLAG`` (auto, 0 or 1): a value outside
    these stops the import with the variable's name and what it takes; the flag's ``auto`` is on for Hopper only,
    where this Triton has the pass (it has: a Triton without it would silently lose the flag on an H100)."""
    import os
    import subprocess
    import sys

    from megabatch.kernels import compile_hooks

    show = "from megabatch.kernels import triton_tiles as t; print(t.GROUP_ROWS)"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=120,
                         env={**env, "MEGABATCH_LOSS_GROUP_M": "16"})
    assert run.stdout.split() == ["16"], run.stderr
    for key, value, hint in (("MEGABATCH_LOSS_GROUP_M", "0", "positive integer"),
                             ("MEGABATCH_LOSS_ACC_FLAG", "yes", "auto (on for Hopper")):
        bad = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=120,
                             env={**env, key: value})
        assert bad.returncode != 0 and f"{key}={value!r}" in bad.stderr and hint in bad.stderr, bad.stderr[-2000:]
    assert compile_hooks.available()
    for setting, hopper, ampere, blackwell in (("auto", True, False, False), ("1", True, True, True),
                                               ("0", False, False, False)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compile_hooks, "ACC_FLAG", setting)
            assert [compile_hooks.enabled(cc) for cc in ((9, 0), (8, 0), (10, 0))] == [hopper, ampere, blackwell]


def test_the_flag_pass_chains_to_a_hook_already_installed(monkeypatch):
    """``compile_hooks.install`` (run at the first flagged launch: on Hopper by default) keeps a stages hook that was
    there before it (inductor's or a user's): that hook still sees every kernel and still gives the cache key's part;
    installing twice wraps once; the pass is added to Hopper's TTGIR stage only, and runs on the named kernels only."""
    from triton import knobs

    from megabatch.kernels import compile_hooks

    seen = []

    def previous(*args):
        if not args:
            return ("theirs", "hash")
        seen.append(args[-1])

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", previous)
    compile_hooks.install()
    hook = knobs.runtime.add_stages_inspection_hook
    compile_hooks.install()
    assert knobs.runtime.add_stages_inspection_hook is hook and hook is not previous
    assert hook() == ("theirs", "hash")

    class Module:
        def __init__(self, name):
            self.name = name

        def get_entry_func_name(self):
            return self.name

    def make(src, metadata):
        return src

    for capability, replaced in ((90, True), (80, False), (100, False)):
        stages = {"ttgir": make}
        hook("backend", stages, None, None, capability)
        assert (stages["ttgir"] is not make) == replaced and seen[-1] == capability
    other = Module("_stats_kernel")  # not one of KERNELS: the pass never runs on it
    assert compile_hooks._flag_accumulator_init(other) is other


def test_the_check_fails_a_wrong_kernel(monkeypatch):
    """Not vacuous: a kernel that drops the column softmax from G' fails the comparison."""
    real = triton_tiles.block_grads

    def half_gradient(rows, cols, scale, row_lse, col_lse, *args, **kwargs):
        return real(rows, cols, scale, row_lse, torch.full_like(col_lse, float("inf")), *args, **kwargs)

    monkeypatch.setattr(triton_tiles, "block_grads", half_gradient)
    with pytest.raises(AssertionError, match="d_rows error"):
        check_against_torch("triton", "fp32", 67, 45, 48, 10.0, False)


def test_symmetric_loss_autograd_matches_dense():
    """The autograd.Function over the kernels: loss value and all three gradients."""
    from megabatch.losses import clip_loss_reference

    rows, cols = features(50, 50, 32, 1, True, torch.float32)
    got = [x.clone().requires_grad_() for x in (rows, cols)]
    scale = torch.tensor(20.0, device=rows.device, requires_grad=True)
    loss = triton_tiles.symmetric_loss(*got, scale, fp32_precision="ieee")
    loss.backward()
    want = [x.double().requires_grad_() for x in (rows, cols)]
    scale64 = torch.tensor(20.0, dtype=torch.float64, device=rows.device, requires_grad=True)
    reference = clip_loss_reference(*want, scale64)
    reference.backward()
    assert rel_error(loss.detach(), reference.detach()) < 1e-6
    for a, b in [(got[0].grad, want[0].grad), (got[1].grad, want[1].grad), (scale.grad, scale64.grad)]:
        assert rel_error(a, b) < 1e-5


def test_clear_errors():
    rows = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        triton_tiles.block_stats(rows, rows, torch.tensor(1.0))
    with pytest.raises(ValueError, match="tf32 or ieee"):
        triton_tiles.block_stats(rows.float(), rows.float(), torch.tensor(1.0), fp32_precision="fp64")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_rows_returned_in_the_features_dtype(impl, monkeypatch):
    """``rows_dtype``: d_rows summed per row block in fp32 and cast when complete equals the fp32
    result cast once (several row and column blocks of G')."""
    small_blocks_of_g(monkeypatch)
    rows, cols = features(67, 45, 48, 5, False, torch.bfloat16)
    scale, weight = torch.tensor(30.0, device=rows.device), torch.tensor(0.01, device=rows.device)
    module = IMPLS[impl]
    row_lse, col_lse = module.block_stats(rows, cols, scale, **tiling(module))
    full = module.block_grads(rows, cols, scale, row_lse, col_lse, weight, False, **tiling(module))
    cast = module.block_grads(rows, cols, scale, row_lse, col_lse, weight, False, **tiling(module),
                              rows_dtype=torch.bfloat16)
    assert cast[0].dtype == torch.bfloat16 and cast[1].dtype == torch.float32
    assert torch.equal(cast[0], full[0].to(torch.bfloat16))
    assert torch.equal(cast[1], full[1]) and torch.equal(cast[2], full[2])


def test_kernel_only_launch_used_by_tuning(monkeypatch):
    """Autotuning and profiling launch the G' kernel alone (no weight, no GEMMs): it runs over
    several blocks and returns sum(G' * dots), the scale gradient before weighting."""
    small_blocks_of_g(monkeypatch)
    rows, cols = features(67, 45, 48, 6, False, torch.float32)
    scale, weight = torch.tensor(30.0, device=rows.device), torch.tensor(0.25, device=rows.device)
    row_lse, col_lse = triton_tiles.block_stats(rows, cols, scale, fp32_precision="ieee")
    dots = triton_tiles._grad_launch(rows, cols, scale, row_lse, col_lse, False, "ieee",
                                    triton_tiles.get_config("grad", rows, "ieee"))
    _, _, d_scale = triton_tiles.block_grads(rows, cols, scale, row_lse, col_lse, weight, False,
                                            fp32_precision="ieee")
    torch.testing.assert_close(dots * weight, d_scale)


@pytest.mark.parametrize("kernel", ["grad", "sigmoid"])
def test_a_tile_past_two_to_the_31_elements(kernel):
    """The last rows of a [rows, 768] block whose element offsets pass 2^31 (~2.8M rows: a 4M batch
    on one rank). One program's tile at the block's end, against float64: 32-bit offsets wrap there
    (a wrong or illegal address). The block is left unwritten except its last rows, so it takes
    almost no memory."""
    c, tile = 768, 16
    m = 2**31 // c + 2 * tile  # every row of the tile starts past 2^31 elements
    generator = torch.Generator().manual_seed(11)
    rows = torch.empty((m, c), dtype=torch.bfloat16, device=DEVICE)  # pages never touched stay unallocated
    last = F.normalize(torch.randn(tile, c, generator=generator, dtype=torch.float64), dim=-1)
    cols = F.normalize(last + 0.5 * torch.randn(tile, c, generator=generator, dtype=torch.float64), dim=-1)
    rows[m - tile:] = last.to(torch.bfloat16).to(DEVICE)
    cols = cols.to(torch.bfloat16).to(DEVICE)
    last, cols64 = rows[m - tile:].double(), cols.double()
    scale = torch.tensor(20.0, device=DEVICE)
    dots = (last @ cols64.T).cpu()
    g = torch.zeros((tile, tile), dtype=torch.float32, device=DEVICE)
    sums = torch.zeros((1, 3), dtype=torch.float32, device=DEVICE)
    shapes = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_K=64, PRECISION="ieee", DIAGONAL=False, UPCAST=True,
                  GROUP_M=1, ROUND_TF32=False, num_warps=4, num_stages=1)
    strides = (rows.stride(0), rows.stride(1), cols.stride(0), cols.stride(1), g.stride(0), g.stride(1))
    if kernel == "grad":
        row_lse = torch.zeros((m,), dtype=torch.float32, device=DEVICE)
        row_lse[m - tile:] = 3.0
        col_lse = torch.full((tile,), 4.0, dtype=torch.float32, device=DEVICE)
        triton_tiles._grad_kernel[(1,)](rows, cols, scale, row_lse, col_lse, g, sums, c, m - tile, m, 0, tile,
                                        1.0, *strides, **shapes)
        logits = 20.0 * dots
        expected = torch.exp(logits - 3.0) + torch.exp(logits - 4.0)
    else:
        bias = torch.tensor(-5.0, device=DEVICE)
        triton_tiles._sigmoid_kernel[(1,)](rows, cols, scale, bias, g, sums, c, m - tile, m, 0, tile, 1.0,
                                           *strides, **shapes, WRITE_G=True, SCALE_SUM=True)
        expected = torch.sigmoid(20.0 * dots - 5.0)  # off the diagonal: g = sigmoid(l)
    torch.testing.assert_close(g.cpu().double(), expected, rtol=1e-5, atol=1e-6)
    assert float(sums[0, 0 if kernel == "grad" else 1]) == pytest.approx(float((expected * dots).sum()), rel=1e-5)
