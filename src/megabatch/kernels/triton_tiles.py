"""Fused Triton kernels for the tiled symmetric contrastive loss on one block of the matrix.

Same math and signatures as the plain-torch reference in ``torch_tiles.py``: a block is ``rows [m, c]``
against ``cols [n, c]``, logits ``S = scale * rows @ cols^T`` (scale applied inside the kernels).

Forward, ``_stats_kernel``: one pass over the tiles gives both directions. Each program owns a
row block and walks a range of column tiles, keeping the row log-sum-exp online in registers;
for every tile it also writes the column-wise (max, sum) of that row block, and those partials
are merged across row blocks afterwards. The columns are processed in stripes sized so the
partials stay within ``PARTIAL_BYTES``: memory is linear in b, never ``b^2 / tile``. A whole tile whose logits
span at most ``SHARED_SHIFT_SPREAD`` (log2 units) takes one exponential a logit for both directions, shifted by
its largest logit (less a headroom), and no column maximum or mask; other tiles shift each row and column by its own
maximum (``MEGABATCH_LOSS_SHARED_SHIFT``).

Backward, hybrid: ``_grad_kernel`` recomputes each tile once and writes a block of
``G' = P_row + P_col - 2 I`` (near-square, up to ``G_BYTES``) in the input dtype, with the per-tile
``sum(G' * rows @ cols^T)`` for the scale gradient; cuBLAS then multiplies the block into
``d_rows`` and ``d_cols`` with fp32 accumulation. With block sides of ~20k the GEMMs do thousands
of FLOP per byte of G' and accumulator traffic, so they stay compute-bound at any b, and no
c-sized accumulator has to live on chip: any feature width works.

Distillation from a teacher: the student's and the teacher's log-sum-exps are each ``_stats_kernel``'s (one dot
product a tile); ``_distill_grad_kernel`` then makes both tiles once, writes G of both terms and sums the
teacher-weighted student logits, the term's cross-entropies' other half (``distill_block``).

Inputs bf16, fp16 or fp32, accumulation in fp32; fp32 inputs use TF32 or exact fp32 dots
(``fp32_precision``). Any m, n (masked edges) and any c (masked K loop). Tile configs come from
``tuned.json`` (committed, per GPU name), else from a GPU there of the same compute capability and SM count
(an H100 SXM takes an H200's: the same 132 SMs), else from a one-off autotune cached on disk.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import uuid
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import compile_hooks
from .torch_tiles import fp32_matmul

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
PARTIAL_BYTES = 256 * 2**20  # column (max, sum) partials of one forward stripe
# one backward block of G' (the loss's extra memory: fp32 accumulators + this): 1152 MiB, sides of 24576 in 16 bits,
# where cuBLAS's GEMMs on G' ran at 74-77% of an H100's bf16 peak against 70-72% at 768 MiB's 19968 and the backward at
# 256k took 5-7% less time (docs/bench/g_sides_h100.json, loss_g_blocks_256k_h100.json). MEGABATCH_LOSS_G_MIB sets it
# (less on a GPU short of memory)
G_MIB = os.environ.get("MEGABATCH_LOSS_G_MIB", "1152")
if not G_MIB.isdigit() or int(G_MIB) < 1:
    raise ValueError(f"MEGABATCH_LOSS_G_MIB={G_MIB!r}: the MiB of one backward block of G' (a positive integer; "
                     "1152 by default, less to spend less GPU memory on the loss)")
G_BYTES = int(G_MIB) * 2**20
# a block with fewer logits takes the default tiles where no tuned ones are known: at 8k x 8k x 512 the whole loss
# takes about a millisecond, while tuning one kernel on a cold GPU takes ~10-30 s of the first step (and of every
# GPU test of a small shape)
TUNE_MIN_LOGITS = 8192 * 8192
G_ALIGN = 256  # G' block sides are multiples of every tile size
FP16_G_SCALE = 2.0**14  # |G'| <= 2: scaled into fp16's normal range, undone in the GEMM's alpha
FP16_MAX = 65504.0
# fp32 features holding bf16 values under tf32 (GradCache's loss): G' is written in fp16, scaled, and the GEMMs take
# fp16 copies of the features. fp16 keeps TF32's 11 significant bits, so the products are as exact as the TF32 GEMMs
# on fp32 G' (the same error against float64 on an H200, docs/bench/g_gemms_h200.json) at the fp16 tensor cores'
# rate, 2.2-2.9x TF32's, on half the bytes. "auto": on a GPU (on the CPU fp32 G' is exact, there being no TF32);
# "1" everywhere (tests); "0" never (fp32 G', TF32 GEMMs)
G_FP16 = os.environ.get("MEGABATCH_LOSS_G_FP16", "auto")
# tiles loaded by Hopper's copy engine through tensor descriptors (TMA): "auto" where the GPU has one (sm_90 and
# newer) and the features' layout allows it (rows contiguous, 16-byte aligned), and under the interpreter; "0" never
# (per-thread loads, the kernels before TMA)
TMA = os.environ.get("MEGABATCH_LOSS_TMA", "auto")
if TMA not in ("auto", "0"):
    raise ValueError(f"MEGABATCH_LOSS_TMA={TMA!r}: auto (tensor descriptors where the GPU and the layout allow) or 0")
# the statistics kernel's shared shift (SHARED_SHIFT_SPREAD): "auto" checked on a GPU since Hopper (timed on an H200:
# the contrastive forward 7% faster at b = 256k; the float64 tests passed compiled there), "1" under the interpreter
# (the tests), off on older GPUs (untimed); "1" on (a branch a tile; the forward's column loop then not flattened),
# "checked" on without a branch (the forward's loop flattened: each program flags a tile past the limit and a second
# launch redoes the flagged programs with each row's and column's own shift), "0" off
SHARED_SHIFT = os.environ.get("MEGABATCH_LOSS_SHARED_SHIFT", "auto")
SHARED_SHIFT_MODES = {"0": 0, "1": 1, "checked": 2}
if SHARED_SHIFT not in ("auto", *SHARED_SHIFT_MODES):
    raise ValueError(f"MEGABATCH_LOSS_SHARED_SHIFT={SHARED_SHIFT!r}: auto (checked on a GPU since Hopper, 1 under "
                     "the interpreter, else off), 1 (on, a branch a tile), checked (on, flagged tiles redone) or 0 "
                     "(off)")
# the forward's tiles whose logits (log2 units) are all within this of the largest take one exponential a logit,
# shifted by the tile's largest (rounded up to an integer) less SHARED_SHIFT_HEADROOM for rows and columns alike:
# every term is then a normal fp32 in [2^-119, 2^32], its exponent's argument below 32 in size (rounded as finely
# as a logit's own); other tiles, and those with rows or columns past the block's edge, take two (``_stats_kernel``).
# The kernels take it as an argument (a test lifts it, or takes it away: -1)
SHARED_SHIFT_SPREAD = 150.0
SHARED_SHIFT_HEADROOM: tl.constexpr = tl.constexpr(32.0)
PERSISTENT_WAVES = 2  # the block kernels' programs per SM (each walks its share of the block's tiles)
# the block kernels' tile order: GROUP_M row blocks of tiles walk the columns together (``_block_tile``), so each
# column tile is read from DRAM about once a group. MEGABATCH_LOSS_GROUP_M sets it (a positive integer); 16-64 read
# less from DRAM and ran no faster on an H100 (docs/bench/loss_group_m_256k_h100.json)
GROUP_M = os.environ.get("MEGABATCH_LOSS_GROUP_M", "8")
if not GROUP_M.isdigit() or int(GROUP_M) < 1:
    raise ValueError(f"MEGABATCH_LOSS_GROUP_M={GROUP_M!r}: the row blocks of tiles that walk the columns together in "
                     "the backward's kernels (a positive integer; 8 by default)")
GROUP_ROWS = int(GROUP_M)
if G_FP16 not in ("auto", "1", "0"):
    raise ValueError(f"MEGABATCH_LOSS_G_FP16={G_FP16!r}: auto (fp16 G' on a GPU), 1 (everywhere) or 0 (fp32 G')")


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _round_tf32(x):
    """fp32 -> the nearest TF32 value (10 mantissa bits, ties away from zero), still as fp32.

    The tensor cores' own fp32 -> TF32 conversion truncates, which shifts every product of a dot
    the same way (towards zero) and biases every logit alike; rounded operands make the errors
    cancel instead, as cuBLAS's TF32 GEMMs do."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot_tile(
    rows_ptr, cols_ptr, m0, n0, offs_m, offs_n, row_ok, col_ok, c,
    stride_rm, stride_rk, stride_cn, stride_ck,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ROUND_TF32: tl.constexpr = False, TMA: tl.constexpr = False,
):
    """``rows[offs_m] @ cols[offs_n]^T`` as a [BLOCK_M, BLOCK_N] fp32 tile, the feature dimension
    ``c`` in steps of BLOCK_K; masked rows and columns read as zeros (inlined into the kernels).
    ``ROUND_TF32`` (fp32 inputs, TF32 dots): operands rounded to nearest first (``_round_tf32``).
    ``TMA``: ``rows_ptr`` and ``cols_ptr`` are tensor descriptors (blocks ``[BLOCK_M, BLOCK_K]`` and
    ``[BLOCK_N, BLOCK_K]``) and the tile starts at row ``m0`` and column ``n0``: Hopper's copy engine loads
    the tiles (no per-thread addresses; rows, columns and features past the tensors' ends read as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if not TMA:
        # element offsets in 64 bits: rows x c passes 2^31 at ~2.8M rows of c = 768 (a 4M batch on one rank)
        row_at = rows_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
        col_at = cols_ptr + offs_n.to(tl.int64)[None, :] * stride_cn
    for k0 in range(0, c, BLOCK_K):
        if TMA:
            a = rows_ptr.load([m0, k0])
            b = cols_ptr.load([n0, k0]).T
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < c
            a = tl.load(row_at + offs_k[None, :] * stride_rk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(col_at + offs_k[:, None] * stride_ck, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if ROUND_TF32:
            a, b = _round_tf32(a), _round_tf32(b)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _exponent_into(shift, x):
    """``(shift + e, m, 2^-e)`` with ``x = m 2^e``, ``m`` in [1, 2), for a normal positive fp32 ``x`` (e in [-126,
    126]) and an integer-valued ``shift``: the same number, ``2^shift x``, as a base-2 (max, sum) pair, and the
    factor that scales another sum of the same terms alike; no rounding (the exponent's bits)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return shift + exponent.to(tl.float32), mantissa, ((127 - exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _stats_own_shifts(acc, scale2, m_i, l_i, row_ok, col_ok, EVEN: tl.constexpr):
    """A forward tile's terms, each row and column shifted by its own maximum (never under/overflows): the rows'
    running ``(max, sum)`` and the columns' ``(max, sum)`` over the tile, base 2 (``EVEN``: no row or column past
    the block's edge, no mask)."""
    s = acc * scale2
    if not EVEN:
        s = tl.where(col_ok[None, :], s, float("-inf"))
    # rows: online log-sum-exp (every tile has a valid column, so m_new is finite)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
    # columns: this row block's share
    if EVEN:
        c_max = tl.max(s, 0)
        return m_new, l_i, c_max, tl.sum(tl.exp2(s - c_max[None, :]), 0)
    s_col = tl.where(row_ok[:, None], s, float("-inf"))
    c_max = tl.where(col_ok, tl.max(s_col, 0), 0.0)  # 0 on padding columns: no inf - inf
    return m_new, l_i, c_max, tl.sum(tl.exp2(s_col - c_max[None, :]), 0)


@triton.jit
def _stats_shared_shift(acc, scale2, m_i, l_i, hi, top):
    """``_stats_own_shifts``' terms for a whole tile whose logits are within ``SHARED_SHIFT_SPREAD`` of each other
    (``hi``: each row's largest logit, ``top`` the tile's): one exponential a logit for both directions, shifted by
    ``top`` rounded up to an integer less SHARED_SHIFT_HEADROOM, every term then a normal fp32 in [2^-119, 2^32], and
    no mask."""
    shift = tl.ceil(top) - SHARED_SHIFT_HEADROOM
    e = tl.exp2(acc * scale2 - shift)
    m_new = tl.maximum(m_i, hi)
    l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(e, 1) * tl.exp2(shift - m_new)
    # a column's share as (shift + its sum's exponent, its sum's mantissa in [1, 2)): exact, and in the (max, sum in
    # [1, BLOCK_M]) form of the other tiles' partials, which the merge sums without under- or overflow
    c_max, c_sum, _ = _exponent_into(shift, tl.sum(e, 0))
    return m_new, l_i, c_max, c_sum


@triton.jit
def _stats_checked_shift(acc, scale2, m_i, l_i, hi, top, row_ok, col_ok, EVEN: tl.constexpr):
    """``_stats_shared_shift`` on any tile, without a branch: rows and columns past the block's edge masked through
    the exponent's argument (-inf) and a row's weight (0), none where ``EVEN``; a tile past the limit is the caller's
    to flag and redo."""
    shift = tl.ceil(top) - SHARED_SHIFT_HEADROOM
    if EVEN:
        e = tl.exp2(acc * scale2 - shift)
    else:
        e = tl.exp2(acc * scale2 + tl.where(col_ok, -shift, float("-inf"))[None, :])
    m_new = tl.maximum(m_i, hi)
    l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(e, 1) * tl.exp2(shift - m_new)
    if EVEN:
        c_max, c_sum, _ = _exponent_into(shift, tl.sum(e, 0))
    else:
        c_max, c_sum, _ = _exponent_into(shift, tl.sum(e * tl.where(row_ok, 1.0, 0.0)[:, None], 0))
    return m_new, l_i, c_max, c_sum


@triton.jit
def _stats_kernel(
    rows_ptr, cols_ptr, scale_ptr, row_max_ptr, row_sum_ptr, col_max_ptr, col_sum_ptr,  # pointers
    m, c, col_start, col_stop, cols_per_split,  # shapes: this launch covers [col_start, col_stop)
    stride_rm, stride_rk, stride_cn, stride_ck, stride_row_part, stride_col_part,  # strides
    spread, flags_ptr,  # SHARED_SHIFT_SPREAD; a flag a program (SHARED 2 and FIXUP)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ROUND_TF32: tl.constexpr, TMA: tl.constexpr = False, SHARED: tl.constexpr = 0,
    FIXUP: tl.constexpr = False, EVEN: tl.constexpr = False,
):
    """Program (i, s): rows [i*BM, (i+1)*BM) against the s-th column split of the stripe.

    Writes the rows' base-2 (max, sum) over the split at ``[s, row]`` and each column's base-2
    (max, sum) over the row block at ``[i, col - col_start]``. ``SHARED`` (``_shared_shift``): 1, a whole tile
    within the limit takes the shared shift (a branch); 2, every tile takes it and the program's flag says whether a
    tile was past the limit; ``FIXUP``, a flagged program redoes its tiles with each row's and column's own shift
    (the others do nothing). ``EVEN``: ``m`` and the launch's columns are whole tiles (no logit masked).
    """
    # split index fastest: the programs running at once share few row blocks (L2 reuse; a
    # [BM, c] row block is re-read for every column tile, and c=768 blocks would thrash L2)
    pid = tl.program_id(0)
    splits = tl.num_programs(0) // tl.cdiv(m, BLOCK_M)
    pid_m, pid_s = pid // splits, pid % splits
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < m
    scale2 = tl.load(scale_ptr).to(tl.float32) * 1.4426950408889634  # logits in log2 units
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    split_start = col_start + pid_s * cols_per_split
    split_stop = tl.minimum(split_start + cols_per_split, col_stop)
    rows_full = (pid_m + 1) * BLOCK_M <= m
    if FIXUP:  # no tile for a program its checked pass did not flag
        flagged = tl.load(flags_ptr + pid) != 0
        split_stop = tl.where(flagged, split_stop, split_start)
    bad = pid < 0  # a tile past the limit (SHARED 2)
    # flattened with the feature loop: the next tile's loads are issued while this one's softmax runs. Not with a
    # branch a tile (SHARED 1): Triton 3.6-3.8 then waits for each tensor-core instruction (kernel_instructions.py
    # shows every HGMMA ending its batch), which the unflattened loop does not
    for j0 in tl.range(split_start, split_stop, BLOCK_N, flatten=SHARED != 1):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < split_stop
        acc = _dot_tile(rows_ptr, cols_ptr, pid_m * BLOCK_M, j0, offs_m, offs_n, row_ok, col_ok, c,
                        stride_rm, stride_rk, stride_cn, stride_ck, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                        ROUND_TF32, TMA)
        if SHARED == 2:
            # as below, every tile, past the block's edges too (their zero dots then count in the tile's range)
            dots_hi, dots_lo = tl.max(acc, 1) * scale2, tl.min(acc, 1) * scale2
            hi = tl.maximum(dots_hi, dots_lo)
            top = tl.max(hi, 0)
            bottom = tl.min(tl.minimum(dots_hi, dots_lo), 0)
            bad = bad | (((top - bottom <= spread) & (tl.abs(top) < 4194304.0)) == 0)
            m_new, l_i, c_max, c_sum = _stats_checked_shift(acc, scale2, m_i, l_i, hi, top, row_ok, col_ok, EVEN)
        elif SHARED == 1:
            # each row's largest and smallest logit (of the dots: a multiply a row, not a logit; either sign of scale)
            dots_hi, dots_lo = tl.max(acc, 1) * scale2, tl.min(acc, 1) * scale2
            hi = tl.maximum(dots_hi, dots_lo)
            top = tl.max(hi, 0)
            bottom = tl.min(tl.minimum(dots_hi, dots_lo), 0)
            # (and logits below 2^22 in size: the shift plus a sum's exponent stays an exact fp32 integer)
            if rows_full & (j0 + BLOCK_N <= split_stop) & (top - bottom <= spread) & (tl.abs(top) < 4194304.0):
                m_new, l_i, c_max, c_sum = _stats_shared_shift(acc, scale2, m_i, l_i, hi, top)
            else:
                m_new, l_i, c_max, c_sum = _stats_own_shifts(acc, scale2, m_i, l_i, row_ok, col_ok, EVEN)
        else:  # compiled away: every tile as _stats_own_shifts
            m_new, l_i, c_max, c_sum = _stats_own_shifts(acc, scale2, m_i, l_i, row_ok, col_ok, EVEN)
        m_i = m_new
        part = pid_m.to(tl.int64) * stride_col_part + offs_n - col_start
        tl.store(col_max_ptr + part, c_max, mask=col_ok)
        tl.store(col_sum_ptr + part, c_sum, mask=col_ok)
    row_part = pid_s.to(tl.int64) * stride_row_part + offs_m  # [splits, m]
    if FIXUP:
        row_ok = row_ok & flagged
    tl.store(row_max_ptr + row_part, m_i, mask=row_ok)
    tl.store(row_sum_ptr + row_part, l_i, mask=row_ok)
    if SHARED == 2:
        tl.store(flags_ptr + pid, bad.to(tl.int32))


@triton.jit
def _block_tiles(row_start, row_stop, col_start, col_stop, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many tiles the block ``[row_start, row_stop) x [col_start, col_stop)`` has: ``(tiles, tiles_n)``."""
    grid_n = tl.cdiv(col_stop - col_start, BLOCK_N)
    return tl.cdiv(row_stop - row_start, BLOCK_M) * grid_n, grid_n


@triton.jit
def _block_tile(t, grid_n, row_start, row_stop, col_start, col_stop,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``t`` of the block ``[row_start, row_stop) x [col_start, col_stop)``: ``(first row, first column,
    row offsets, column offsets, row mask, column mask)``. Grouped order: GROUP_M row blocks share each column tile
    while it is in L2. The kernels that walk a block are persistent: program ``p`` takes tiles ``p``, ``p +
    programs``, ... (``tl.range`` flattened with the feature loop, so a tile's loads overlap the last one's
    epilogue)."""
    grid_m = tl.cdiv(row_stop - row_start, BLOCK_M)
    group = t // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (t % (GROUP_M * grid_n)) % group_m
    pid_n = (t % (GROUP_M * grid_n)) // group_m
    m0 = row_start + pid_m * BLOCK_M
    n0 = col_start + pid_n * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return m0, n0, offs_m, offs_n, offs_m < row_stop, offs_n < col_stop


@triton.jit
def _store_g(g_ptr, g, m0, n0, offs_m, offs_n, ok, row_start, col_start, stride_gm, stride_gn,
             G_TMA: tl.constexpr):
    """A tile of G (already scaled) into the block buffer at ``(m0 - row_start, n0 - col_start)``: through a tensor
    descriptor (``G_TMA``: the copy engine writes the tile from shared memory, cut at the block's edges), else by
    each thread (masked by ``ok``)."""
    if G_TMA:
        g_ptr.store([m0 - row_start, n0 - col_start], g.to(g_ptr.dtype))
    else:
        g_offs = (offs_m - row_start).to(tl.int64)[:, None] * stride_gm + (offs_n - col_start)[None, :] * stride_gn
        tl.store(g_ptr + g_offs, g.to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _power_of_two_parts(x):
    """``(log2(x), 1 / x)`` of a normal power of two ``x``, exactly, from its bits (no logarithm or division, whose
    GPU forms need not be exact)."""
    bits = tl.cast(x, tl.float32).to(tl.int32, bitcast=True)
    return ((bits >> 23) - 127).to(tl.float32), ((254 << 23) - bits).to(tl.float32, bitcast=True)


@triton.jit
def _grad_kernel(
    rows_ptr, cols_ptr, scale_ptr, row_lse_ptr, col_lse_ptr, g_ptr, dscale_ptr,  # pointers
    c, row_start, row_stop, col_start, col_stop, g_scale,  # shapes: this launch's block of G'
    stride_rm, stride_rk, stride_cn, stride_ck, stride_gm, stride_gn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DIAGONAL: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr, ROUND_TF32: tl.constexpr,
    TMA: tl.constexpr = False, G_TMA: tl.constexpr = False, ACC_FLAG: tl.constexpr = False,
):
    """This program's tiles of ``G' = P_row + P_col - 2 I`` (rows [row_start, row_stop) x columns
    [col_start, col_stop) of the block) into the buffer, times ``g_scale``, and their
    ``sum(G' * rows @ cols^T)`` into ``dscale_ptr[program]``."""
    tiles, grid_n = _block_tiles(row_start, row_stop, col_start, col_stop, BLOCK_M, BLOCK_N)
    scale2 = tl.load(scale_ptr).to(tl.float32) * 1.4426950408889634
    # g_scale, a power of two, in the exponentials' arguments (an integer off the log-sum-exps, rounded at most as
    # finely as the arguments themselves): G' comes out scaled, with no multiply a logit; the sum is undone at the end
    g_shift, inv_g_scale = _power_of_two_parts(g_scale)
    dscale = tl.zeros((BLOCK_M,), tl.float32)
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        m0, n0, offs_m, offs_n, row_ok, col_ok = _block_tile(t, grid_n, row_start, row_stop, col_start, col_stop,
                                                             BLOCK_M, BLOCK_N, GROUP_M)
        acc = _dot_tile(rows_ptr, cols_ptr, m0, n0, offs_m, offs_n, row_ok, col_ok, c,
                        stride_rm, stride_rk, stride_cn, stride_ck, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                        ROUND_TF32, TMA)
        row_lse2 = tl.load(row_lse_ptr + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634 - g_shift
        col_lse2 = tl.load(col_lse_ptr + offs_n, mask=col_ok, other=0.0) * 1.4426950408889634 - g_shift
        s = acc * scale2
        g = tl.exp2(s - row_lse2[:, None]) + tl.exp2(s - col_lse2[None, :])
        if DIAGONAL:
            g = tl.where(offs_m[:, None] == offs_n[None, :], g - 2.0 * g_scale, g)
        # no mask: outside the block the dots read zeros (acc = 0, so g * acc = 0) and G' is stored cut at its edges
        dscale += tl.sum(g * acc, 1)
        _store_g(g_ptr, g, m0, n0, offs_m, offs_n, row_ok[:, None] & col_ok[None, :], row_start,
                 col_start, stride_gm, stride_gn, G_TMA)
    tl.store(dscale_ptr + tl.program_id(0), tl.sum(dscale, 0) * inv_g_scale)


@triton.jit
def _log2_1p(e):
    """``log2(1 + e)`` for ``e`` in [0, 1], on the FMA units: ``e q(e)``, ``q`` the degree-8 least-squares fit of
    ``log2(1 + e) / e`` at 4,000 Chebyshev nodes of [0, 1] (``numpy.polynomial.chebyshev.chebfit``, turned into
    powers of ``e``), its coefficients rounded to fp32: at most 3 ulps from float64's value over the range,
    relatively, so a small ``e`` keeps all its bits, which ``log2`` of a rounded ``1 + e`` would not. ``tl.log2`` is
    libdevice's full-range log2f (~25 instructions a value); this is 9."""
    q = tl.fma(e, 0.007579137571156025, -0.04268719255924225)
    q = tl.fma(q, e, 0.11305198818445206)
    q = tl.fma(q, e, -0.1972852200269699)
    q = tl.fma(q, e, 0.27571967244148254)
    q = tl.fma(q, e, -0.3584284782409668)
    q = tl.fma(q, e, 0.4806954860687256)
    q = tl.fma(q, e, -0.7213403582572937)
    q = tl.fma(q, e, 1.4426950216293335)
    return q * e


@triton.jit
def _one_plus_product(a, b):
    """``(1 + a)(1 + b) - 1``, the product of ``1 + a`` and ``1 + b`` less one: kept this way, a small ``a`` or ``b``
    keeps its bits (each step rounds once relatively, the terms all non-negative), which a product of rounded
    ``1 + e`` would not."""
    return tl.fma(a, b, a + b)


@triton.jit
def _log2_1p_row(e):
    """``sum(log2(1 + e), 1)`` for ``e`` in [0, 1] and at most 128 columns: ``log2`` of the row's product of ``1 + e``
    (held as the product less one, ``_one_plus_product``), one ``log2`` a row in place of one a value. The product is
    at most 2^128: below 1 the polynomial of ``_log2_1p`` on it, else ``1 + q = 2^k (1 + f)`` read from its bits,
    ``k + _log2_1p(f)`` (a product past fp32's largest number is ``inf``, whose bits read 128 + 0: only 128 columns,
    all with ``e`` within 2e-5 of 1, get there, and their sum is 128 within that)."""
    q = tl.reduce(e, 1, _one_plus_product)
    bits = (1.0 + q).to(tl.int32, bitcast=True)
    big = q >= 1.0
    k = ((bits >> 23) - 127).to(tl.float32)
    f = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    return _log2_1p(tl.where(big, f, q)) + tl.where(big, k, 0.0)


@triton.jit
def _log2_1p_sum(e, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``sum(log2(1 + e), 1)`` for a tile of ``e`` in [0, 1]: ``_log2_1p_row`` on its columns, or on its even and odd
    columns apart where a row is wider than 128 (each part's product then stays within fp32's range)."""
    if BLOCK_N > 128:
        even, odd = tl.split(tl.reshape(e, [BLOCK_M, BLOCK_N // 2, 2]))
        return _log2_1p_row(even) + _log2_1p_row(odd)
    else:
        return _log2_1p_row(e)


@triton.jit
def _reciprocal(u, FAST: tl.constexpr):
    """``1 / u`` for a normal ``u`` whose reciprocal is normal: ``FAST`` (a CUDA GPU) the hardware's reciprocal alone
    (``rcp.approx``, within 1 ulp), where ``1 / u`` compiles to a full-range division (within 2 ulps: the reciprocal, a
    product and the range checks around them); the interpreter, which runs no PTX, divides."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 / u


@triton.jit
def _sigmoid_kernel(
    rows_ptr, cols_ptr, scale_ptr, bias_ptr, g_ptr, sums_ptr,  # pointers
    c, row_start, row_stop, col_start, col_stop, inv_g_scale,  # shapes: this launch's block; 1 / g_scale
    stride_rm, stride_rk, stride_cn, stride_ck, stride_gm, stride_gn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DIAGONAL: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr, ROUND_TF32: tl.constexpr,
    WRITE_G: tl.constexpr, SCALE_SUM: tl.constexpr, TMA: tl.constexpr = False, G_TMA: tl.constexpr = False,
    FAST_RCP: tl.constexpr = False, ACC_FLAG: tl.constexpr = False, EVEN: tl.constexpr = False,
):
    """This program's tiles of the sigmoid loss: with ``l = scale * dots + bias`` and ``-z`` = -1 on the
    diagonal of a DIAGONAL block, +1 elsewhere, writes ``[sum softplus(-z l), sum g * dots, sum g]``
    at ``sums_ptr[3 * program]`` and ``g = -z sigmoid(-z l)``, times ``g_scale`` (a power of two), into the block
    buffer (WRITE_G; without it only the loss sum; without SCALE_SUM not ``sum g * dots``; ``EVEN``: the tiles cover
    the block exactly, so no logit needs a mask). One
    exponential and one reciprocal (``_reciprocal``) per logit, and the loss's logarithm once per row of a tile
    (``_log2_1p_sum``)."""
    tiles, grid_n = _block_tiles(row_start, row_stop, col_start, col_stop, BLOCK_M, BLOCK_N)
    # log2 units: exp2 is the hardware's own (no multiply inside)
    scale2 = tl.load(scale_ptr).to(tl.float32) * 1.4426950408889634
    bias2 = tl.load(bias_ptr).to(tl.float32) * 1.4426950408889634
    loss_sum = tl.zeros((BLOCK_M,), tl.float32)
    dots_sum = tl.zeros((BLOCK_M,), tl.float32)
    g_sum = tl.zeros((BLOCK_M,), tl.float32)
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        m0, n0, offs_m, offs_n, row_ok, col_ok = _block_tile(t, grid_n, row_start, row_stop, col_start, col_stop,
                                                             BLOCK_M, BLOCK_N, GROUP_M)
        dots = _dot_tile(rows_ptr, cols_ptr, m0, n0, offs_m, offs_n, row_ok, col_ok, c,
                         stride_rm, stride_rk, stride_cn, stride_ck, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                         ROUND_TF32, TMA)
        margin = dots * scale2 + bias2  # -z l / ln 2, off the diagonal
        diagonal = offs_m[:, None] == offs_n[None, :]
        if DIAGONAL:
            margin = tl.where(diagonal, -margin, margin)
        ok = row_ok[:, None] & col_ok[None, :]
        if not EVEN:  # outside the block -inf: its loss (0 + log2(1 + 0)) and g (0) are then zeros, no further mask
            margin = tl.where(ok, margin, float("-inf"))
        e = tl.exp2(-tl.abs(margin))  # in [0, 1]: never overflows
        # softplus(-z l) / ln 2 = max(margin, 0) + log2(1 + e), the last term summed as the log of a row's product
        # of 1 + e, held less one (SigLIP's off-diagonal terms are ~e^-10 each: a rounded 1 + e keeps few of their bits)
        loss_sum += tl.sum(tl.maximum(margin, 0.0), 1) + _log2_1p_sum(e, BLOCK_M, BLOCK_N)
        if WRITE_G:
            # sigmoid(-z l) times g_scale, a power of two: the reciprocal of (1 + e) / g_scale, rounded as 1 + e is,
            # is g_scale / (1 + e) exactly (no multiply a logit); the sums are of g times g_scale, undone at the end
            g = tl.where(margin >= 0, 1.0, e) * _reciprocal(tl.fma(e, inv_g_scale, inv_g_scale), FAST_RCP)
            if DIAGONAL:
                g = tl.where(diagonal, -g, g)
            if SCALE_SUM:  # else the launcher takes sum(g * dots) from the row gradients
                dots_sum += tl.sum(g * dots, 1)
            g_sum += tl.sum(g, 1)
            _store_g(g_ptr, g, m0, n0, offs_m, offs_n, ok, row_start, col_start, stride_gm, stride_gn, G_TMA)
    pid = tl.program_id(0)
    tl.store(sums_ptr + 3 * pid, tl.sum(loss_sum, 0) * 0.6931471805599453)
    if WRITE_G:
        if SCALE_SUM:
            tl.store(sums_ptr + 3 * pid + 1, tl.sum(dots_sum, 0) * inv_g_scale)
        tl.store(sums_ptr + 3 * pid + 2, tl.sum(g_sum, 0) * inv_g_scale)


@triton.jit
def _distill_grad_kernel(
    rows_ptr, cols_ptr, t_rows_ptr, t_cols_ptr, scale_ptr, t_scale, lse_ptr, g_ptr, cross_ptr,
    m, n, c, ct, row_start, row_stop, col_start, col_stop, g_scale, t_weight, diagonal_weight, diagonal_offset,
    stride_rm, stride_rk, stride_cn, stride_ck, stride_trm, stride_trk, stride_tcn, stride_tck,
    stride_gm, stride_gn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ROUND_TF32: tl.constexpr, T_UPCAST: tl.constexpr, T_ROUND_TF32: tl.constexpr,
    GROUP_M: tl.constexpr, DIAGONAL: tl.constexpr, TMA: tl.constexpr = False, G_TMA: tl.constexpr = False,
    EVEN: tl.constexpr = False, WRITE_G: tl.constexpr = True,
):
    """This program's tiles of ``G = P_row(S) + P_col(S) - t_weight (P_row(T) + P_col(T))`` (the distillation term's
    gradient in the logits, both directions; ``DIAGONAL``: less ``2 diagonal_weight`` where the column is the row
    plus ``diagonal_offset``, the contrastive loss's positives, which with ``t_weight`` and ``diagonal_weight``
    the two terms' weights over their sum gives both losses' gradient at once) into the buffer, times
    ``g_scale`` (``WRITE_G``; without it the sum alone), and the tile's teacher-weighted dots
    ``sum((P_row(T) + P_col(T)) * rows @ cols^T)`` (the term's cross-entropies' other half) into
    ``cross_ptr[program]``. ``lse_ptr``: ``[m + n + m + n]``, the student's row and column log-sum-exps, then the
    teacher's."""
    tiles, grid_n = _block_tiles(row_start, row_stop, col_start, col_stop, BLOCK_M, BLOCK_N)
    scale2 = tl.load(scale_ptr).to(tl.float32) * 1.4426950408889634
    t_scale2 = t_scale * 1.4426950408889634
    g_shift, inv_g_scale = _power_of_two_parts(g_scale)  # in the exponentials' arguments, as _grad_kernel
    cross = tl.zeros((BLOCK_M,), tl.float32)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        m0, n0, offs_m, offs_n, row_ok, col_ok = _block_tile(tile, grid_n, row_start, row_stop, col_start,
                                                             col_stop, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _dot_tile(rows_ptr, cols_ptr, m0, n0, offs_m, offs_n, row_ok, col_ok, c,
                        stride_rm, stride_rk, stride_cn, stride_ck, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST,
                        ROUND_TF32, TMA)
        t_acc = _dot_tile(t_rows_ptr, t_cols_ptr, m0, n0, offs_m, offs_n, row_ok, col_ok, ct,
                          stride_trm, stride_trk, stride_tcn, stride_tck, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                          T_UPCAST, T_ROUND_TF32, TMA)
        t = t_acc * t_scale2
        t_row_lse = tl.load(lse_ptr + m + n + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634 - g_shift
        t_col_lse = tl.load(lse_ptr + 2 * m + n + offs_n, mask=col_ok, other=0.0) * 1.4426950408889634 - g_shift
        p = tl.exp2(t - t_row_lse[:, None]) + tl.exp2(t - t_col_lse[None, :])
        ok = row_ok[:, None] & col_ok[None, :]
        if not EVEN:
            p = tl.where(ok, p, 0.0)
        cross += tl.sum(p * acc, 1)
        if WRITE_G:
            s = acc * scale2
            row_lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634 - g_shift
            col_lse = tl.load(lse_ptr + m + offs_n, mask=col_ok, other=0.0) * 1.4426950408889634 - g_shift
            g = tl.exp2(s - row_lse[:, None]) + tl.exp2(s - col_lse[None, :]) - t_weight * p
            if DIAGONAL:
                g = tl.where(offs_m[:, None] + diagonal_offset == offs_n[None, :], g - 2.0 * diagonal_weight * g_scale,
                             g)
            if not EVEN:
                g = tl.where(ok, g, 0.0)
            _store_g(g_ptr, g, m0, n0, offs_m, offs_n, ok, row_start, col_start, stride_gm, stride_gn, G_TMA)
    tl.store(cross_ptr + tl.program_id(0), tl.sum(cross, 0) * inv_g_scale)


# ----------------------------------------------------------------------------------------------
# Tile configs: committed per GPU, else tuned once and cached, else a safe default
# ----------------------------------------------------------------------------------------------
TUNED_FILE = Path(__file__).with_name("tuned.json")
KERNELS = ("stats", "grad", "sigmoid", "distill_grad")  # the kernels with tile configs (tuned.json's keys' first part)
DEVICES = "_devices"  # tuned.json's record of each GPU's compute capability and SM count (``device_record``)
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def default_config(dtype: torch.dtype) -> dict:
    """Untuned tiles that fit any GPU since Ampere (fp32 halves BLOCK_K: ~100 KB shared memory)."""
    return {**DEFAULT_CONFIG, "BLOCK_K": 32} if dtype == torch.float32 else DEFAULT_CONFIG


def candidate_configs(dtype: torch.dtype) -> list[dict]:
    """Hopper-sized candidates (fp32 tiles take twice the shared memory per element). Two stages: a tile whose
    buffers then take less than half an SM's shared memory lets two programs share the SM, one's epilogue beside the
    other's dots (the H100's forward at c = 512, 128 x 128 at 4 warps: 51.5% of the bf16 peak at 2 stages, 46.4% at
    the best of the 3- and 4-stage candidates, 8 warps at 3; ``docs/bench/loss_two_per_sm_256k_h100.json``)."""
    ks = (32, 64) if dtype == torch.float32 else (64,)  # 16-bit tiles of 128 features lost everywhere measured
    shapes = [(128, 128, 8), (128, 256, 8), (256, 128, 8), (64, 128, 4), (128, 64, 4), (128, 128, 4)]
    out = []
    for bm, bn, warps in shapes:
        for bk in ks:
            for stages in (2, 3, 4):
                smem = (bm + bn) * bk * (4 if dtype == torch.float32 else 2) * stages
                if smem <= 200 * 1024:
                    out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                                "num_warps": warps, "num_stages": stages})
    return out


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def config_key(kernel: str, dtype: torch.dtype, c: int, precision: str) -> str:
    width = 1 << max(6, math.ceil(math.log2(c)))  # c=768 and c=1024 share a bucket
    name = str(dtype).removeprefix("torch.")
    return f"{kernel}/{name}/{precision if dtype == torch.float32 else 'native'}/c{width}"


def tuning_cache_file() -> Path:
    """This host's tuned tile configs (``$MEGABATCH_CACHE/triton_tuned.json``), read after ``tuned.json``."""
    root = os.environ.get("MEGABATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megabatch")
    return Path(root) / "triton_tuned.json"


def device_record(device) -> dict:
    """What decides a GPU's best tiles: its compute capability (the instructions, shared memory and registers of
    an SM) and SM count (the waves of programs). GPUs that share both (H100 SXM and H200: sm_90, 132 SMs; they
    differ in memory, which these compute-bound kernels barely touch) take each other's tables."""
    props = torch.cuda.get_device_properties(device)
    return {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count}


@functools.cache
def _shipped() -> dict:
    return json.loads(TUNED_FILE.read_text()) if TUNED_FILE.exists() else {}


def sibling_config(gpu: str, key: str, record, shipped: dict | None = None) -> tuple[str, dict] | None:
    """``(other GPU, its config)``: ``key``'s shipped config of another GPU in ``tuned.json`` (or ``shipped``, a table
    of its layout) whose recorded ``device_record`` equals this one's (``record()``, called only where another GPU
    has the key), the first by name; else ``None``."""
    shipped = _shipped() if shipped is None else shipped
    others = [other for other in sorted(shipped.get(DEVICES, {})) if other != gpu and key in shipped.get(other, {})]
    if not others:
        return None
    mine = record()
    for other in others:
        if shipped[DEVICES][other] == mine:
            return other, shipped[other][key]
    return None


@functools.cache
def _load_tables(gpu: str) -> dict:
    """``gpu``'s shipped table and this host's tuned one over it (a copy: ``get_config`` adds to it)."""
    tables = dict(_shipped().get(gpu, {}))
    path = tuning_cache_file()
    if path.exists():
        tables.update(json.loads(path.read_text()).get(gpu, {}))
    return tables


def get_config(kernel: str, rows: torch.Tensor, precision: str, cols: int | None = None) -> dict:
    """The tile config for ``kernel`` on these inputs' GPU, dtype and width: the shipped or this host's tuned one,
    else tuned now (once per host), except for a block of fewer than ``TUNE_MIN_LOGITS`` logits (``rows`` x ``cols``
    rows), which takes the default tiles: its loss takes milliseconds, a tuning tens of seconds."""
    if interpreting() or not rows.is_cuda:
        return INTERPRET_CONFIG
    gpu = torch.cuda.get_device_name(rows.device)
    key = config_key(kernel, rows.dtype, rows.shape[1], precision)
    table = _load_tables(gpu)
    if key not in table and rows.dtype == torch.float16:  # same element size: bf16's tiles fit
        bf16_key = config_key(kernel, torch.bfloat16, rows.shape[1], precision)
        key = bf16_key if bf16_key in table else key
    if key not in table:  # another GPU's of the same SMs, shipped: no tuning at the first step
        record = functools.cache(lambda: device_record(rows.device))
        sibling = sibling_config(gpu, key, record)
        if sibling is None and rows.dtype == torch.float16:  # as above: bf16's tiles fit
            bf16_key = config_key(kernel, torch.bfloat16, rows.shape[1], precision)
            sibling = sibling_config(gpu, bf16_key, record)
            key = bf16_key if sibling is not None else key
        if sibling is not None:
            log.info("Triton loss kernel %s on %s: %s's shipped tiles (the same compute capability and SM count; "
                     "scripts/tune_kernels.py --missing --merge tunes this GPU's own)", key, gpu, sibling[0])
            table[key] = sibling[1]
    if key not in table:
        small = rows.shape[0] * (rows.shape[0] if cols is None else cols) < TUNE_MIN_LOGITS
        if small or os.environ.get("MEGABATCH_AUTOTUNE", "1") == "0":
            return default_config(rows.dtype)
        table[key] = tuned_once(gpu, key, lambda: tune(kernel, rows.dtype, rows.shape[1], precision, rows.device,
                                                       verbose=False))
    return table[key]


def tuned_once(gpu: str, key: str, tune_now, path: Path | None = None, stale: dict | None = None) -> dict:
    """``key``'s config for ``gpu`` from the cache file, tuned by ``tune_now()`` and saved there by the
    first process of the host to ask: the ranks of a run reach the same kernels at once, and one of
    them tunes while the others wait on the file's lock and then read its result (a tuning per rank
    took ~30 s before the first step, 4 GPUs each timing candidates beside the others). ``stale``: a config that
    did not fit, tuned again where the file holds it."""
    import fcntl

    path = path or tuning_cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        try:
            saved = json.loads(path.read_text()).get(gpu, {}) if path.exists() else {}
        except json.JSONDecodeError:  # a file cut short by a crash: tuned again, written whole
            saved = {}
        if key in saved and saved[key] != stale:
            return saved[key]
        log.info("tuning the Triton loss kernel %s for %s (once per host; cached in %s)", key, gpu, path)
        config = tune_now()
        save_config(gpu, key, config, path)
        return config


def save_config(gpu: str, key: str, config: dict, path: Path, record: dict | None = None) -> None:
    """``key``'s ``config`` for ``gpu`` into the table at ``path``, with the GPU's ``device_record`` where given
    (``tuned.json``: what lets another GPU of the same SMs take it)."""
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:  # cut short (a crash before atomic writes): written whole again
        data = {}
    data.setdefault(gpu, {})[key] = config
    if record is not None:
        data.setdefault(DEVICES, {})[gpu] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name no other writer has, whatever host or process it is (a cache on a filesystem several nodes share)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def tune(kernel: str, dtype: torch.dtype, c: int, precision: str, device, size: int = 16384,
         verbose: bool = True, timings: list | None = None) -> dict:
    """Benchmark every candidate on a ``size x size x c`` block; returns the fastest config. Each is timed by the
    median of ~100 ms of launches after ~25 ms of warm-up (until 2026-12 the mean of 20 ms, a handful of launches at
    16k, where a slow launch or two could move a candidate's rank). ``scripts/tune_kernels.py --size`` sets ``size``
    (24576, one block of G' at 16 bits, times the backward's kernels as a large batch runs them). ``timings``, if
    given, receives a row a candidate: its key, width, config and milliseconds, or why it did not run."""
    from triton import testing

    launch = _launcher(kernel, dtype, c, precision, device, size)
    key = config_key(kernel, dtype, c, precision)
    best, best_ms = default_config(dtype), float("inf")
    for config in candidate_configs(dtype):
        fn = functools.partial(launch, config)
        row = {"key": key, "kernel": kernel, "dim": c, "size": size, "config": config}
        try:
            ms = testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as error:  # out of shared memory / registers for this GPU: skip it
            if verbose:
                print(f"  tune {kernel} {config}: skipped ({type(error).__name__})")
            if timings is not None:
                timings.append({**row, "skipped": type(error).__name__})
            continue
        if timings is not None:
            timings.append({**row, "ms": ms})
        if verbose:
            print(f"  tune {kernel} {dtype} c={c} {config}: {ms:.3f} ms")
        if ms < best_ms:
            best, best_ms = config, ms
    return best


def _launcher(kernel: str, dtype: torch.dtype, c: int, precision: str, device, size: int):
    """``launch(config)``: ``kernel``'s pass on a ``size x size x c`` block of random unit rows (a distillation
    teacher as wide as the student), as ``tune`` times it."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: the tuned kernels are {', '.join(KERNELS)}")
    rows = torch.nn.functional.normalize(torch.randn(size, c, device=device), dim=-1).to(dtype)
    cols = torch.nn.functional.normalize(torch.randn(size, c, device=device), dim=-1).to(dtype)
    scale = torch.tensor(50.0, device=device)
    row_lse, col_lse = block_stats(rows, cols, scale, fp32_precision=precision, config=default_config(dtype))

    def launch(config: dict):
        if kernel == "stats":
            return _stats_launch(rows, cols, scale, precision, config)
        if kernel == "distill_grad":
            lse = torch.cat([row_lse, col_lse, row_lse, col_lse])
            return _distill_launch(rows, cols, cols, rows, scale, 100.0, lse, precision, config)
        if kernel == "sigmoid":
            return _sigmoid_launch(rows, cols, scale, torch.tensor(-10.0, device=device), True, precision, config,
                                   grads=False, write_g=True)
        return _grad_launch(rows, cols, scale, row_lse, col_lse, True, precision, config)

    return launch


def fits(kernel: str, dtype: torch.dtype, c: int, precision: str, config: dict, device, size: int = 1024) -> bool:
    """Whether ``config``'s tiles of ``kernel`` compile within this GPU's shared memory and registers (a config
    tuned before a kernel changed may not: ``scripts/tune_kernels.py --check``)."""
    try:
        _launcher(kernel, dtype, c, precision, device, size)(config)
        torch.cuda.synchronize(device)
    except triton.runtime.errors.OutOfResources:
        return False
    return True


def _with_fitting_config(kernel: str, operands: torch.Tensor, precision: str, cols: int, config: dict | None,
                         launch):
    """``launch(config)`` with the given config, else with ``get_config``'s; where that one does not fit this GPU
    (shared memory or registers: a shipped or cached config tuned before the kernel changed), the key is tuned again
    here (``retune``) and the launch made with the new one. The error comes from the kernel's first launch, before
    it has written anything, so the second launch starts from the same buffers."""
    if config is not None:
        return launch(config)
    config = get_config(kernel, operands, precision, cols)
    try:
        return launch(config)
    except triton.runtime.errors.OutOfResources as error:
        return launch(retune(kernel, operands, precision, cols, config, error))


def retune(kernel: str, rows: torch.Tensor, precision: str, cols: int, stale: dict, error: Exception) -> dict:
    """A config in place of ``stale``, which did not fit this GPU: tuned now (once per host; cached over the shipped
    table), or the default tiles where ``get_config`` would not tune."""
    gpu = torch.cuda.get_device_name(rows.device)
    key = config_key(kernel, rows.dtype, rows.shape[1], precision)
    log.warning("Triton loss kernel %s on %s: the tiles %s do not fit this GPU (%s); tuning them again (once per "
                "host; scripts/tune_kernels.py --check --merge fixes the shipped table)", key, gpu, stale, error)
    table = _load_tables(gpu)
    small = rows.shape[0] * cols < TUNE_MIN_LOGITS
    if small or os.environ.get("MEGABATCH_AUTOTUNE", "1") == "0":
        table[key] = default_config(rows.dtype)
    else:
        table[key] = tuned_once(gpu, key, lambda: tune(kernel, rows.dtype, rows.shape[1], precision, rows.device,
                                                       verbose=False), stale=stale)
    return table[key]


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def _sms(device) -> int:
    if not torch.cuda.is_available() or interpreting():
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _ptx(t: torch.Tensor) -> bool:
    """Whether a kernel on ``t`` compiles to PTX (an NVIDIA GPU, not the interpreter): inline PTX may run there."""
    return t.is_cuda and torch.version.hip is None and not interpreting()


def _power_of_two(g_scale: float) -> float:
    """``g_scale``, which the G-writing kernels fold into their exponentials or reciprocals exactly, only if it is a
    power of two."""
    if math.frexp(g_scale)[0] != 0.5:
        raise ValueError(f"g_scale {g_scale} is not a power of two (the kernels fold it into G exactly)")
    return g_scale


def _even(height: int, width: int, config: dict) -> bool:
    """Whether ``config``'s tiles cover a ``height`` x ``width`` block exactly (a kernel then masks no logit)."""
    return height % config["BLOCK_M"] == 0 and width % config["BLOCK_N"] == 0


def _acc_flag(t: torch.Tensor) -> bool:
    """Whether the block kernels on ``t`` are compiled with their accumulator's reset as the tensor cores' flag
    (``compile_hooks``: ``MEGABATCH_LOSS_ACC_FLAG``, by default on for Hopper); the hook is installed on the first
    such call."""
    if not (_ptx(t) and compile_hooks.enabled(torch.cuda.get_device_capability(t.device))):
        return False
    compile_hooks.install()
    return True


def _shared_shift(rows: torch.Tensor) -> int:
    """How the statistics kernel on ``rows`` takes the shared shift (``SHARED_SHIFT``): 0 not, 1 a branch a tile,
    2 checked (flagged programs redone)."""
    if SHARED_SHIFT == "auto":  # checked where timed (an H200: the forward 7% faster), 1 interpreted (the tests)
        if not _ptx(rows):
            return 1
        return 2 if torch.cuda.get_device_capability(rows.device)[0] >= 9 else 0
    return SHARED_SHIFT_MODES[SHARED_SHIFT]


def _upcast(rows: torch.Tensor) -> bool:
    """bf16 dots upcast to fp32 under the interpreter only: its numpy ``tl.dot`` mishandles bf16.
    The products of bf16 values are exact in fp32, so the math is the GPU's."""
    return interpreting() and rows.dtype == torch.bfloat16


def _operands(a: torch.Tensor, b: torch.Tensor, config: dict) -> tuple:
    """A kernel's two dot operands as it loads them: ``(a, b, tma)``, tensor descriptors of ``[BLOCK_M, BLOCK_K]``
    and ``[BLOCK_N, BLOCK_K]`` blocks where TMA can load them (``TMA``: a GPU since Hopper or the interpreter, each
    row contiguous and 16-byte aligned), else the tensors themselves."""
    def fits(t: torch.Tensor) -> bool:
        rows_ok = t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        return rows_ok and t.shape[0] > 0 and config["BLOCK_K"] * t.element_size() >= 16
    gpu = interpreting() or (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] >= 9)
    if TMA == "0" or not gpu or not (fits(a) and fits(b)):
        return a, b, False
    return (TensorDescriptor.from_tensor(a, [config["BLOCK_M"], config["BLOCK_K"]]),
            TensorDescriptor.from_tensor(b, [config["BLOCK_N"], config["BLOCK_K"]]), True)


def _student_and_teacher_operands(rows, cols, t_rows, t_cols, config: dict) -> tuple:
    """The distillation kernel's four dot operands, all loaded one way: ``(rows, cols, t_rows, t_cols, tma)``,
    through tensor descriptors only where both pairs allow it (``_operands``)."""
    rows_arg, cols_arg, tma = _operands(rows, cols, config)
    t_rows_arg, t_cols_arg, t_tma = _operands(t_rows, t_cols, config)
    if tma != t_tma:
        return rows, cols, t_rows, t_cols, False
    return rows_arg, cols_arg, t_rows_arg, t_cols_arg, tma


def _g_target(g_block: torch.Tensor, config: dict, tma: bool):
    """Where a block kernel writes G: ``(g, g_tma)``, a tensor descriptor of ``[BLOCK_M, BLOCK_N]`` tiles over the
    block where its operands load through TMA, else the block itself."""
    if not tma or g_block.numel() <= 1:  # no G written (a kernel of sums only): its placeholder
        return g_block, False
    return TensorDescriptor(g_block, list(g_block.shape), list(g_block.stride()),
                            [config["BLOCK_M"], config["BLOCK_N"]]), True


def _programs(tiles: int, device) -> int:
    """A persistent block kernel's programs: ``PERSISTENT_WAVES`` per SM, at most one per tile."""
    return max(1, min(tiles, PERSISTENT_WAVES * _sms(device)))


def _stripes(m: int, n: int, config: dict, device, fields: int) -> tuple[int, int, int, int]:
    """A stats pass's layout: ``(row_blocks, stripe, cols_per_split, splits)``. The stripe width keeps the column
    partials ``[row_blocks, stripe]`` x ``fields`` fp32 within PARTIAL_BYTES; each stripe's columns are split
    over programs: >= 4 waves of programs on the GPU, and >= 8 splits (of >= 8 column tiles each) so the
    programs running at once share row blocks."""
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    row_blocks = triton.cdiv(m, bm)
    stripe = max(bn, (PARTIAL_BYTES // (4 * fields * row_blocks)) // bn * bn)
    stripe = min(stripe, triton.cdiv(n, bn) * bn)
    tiles = triton.cdiv(stripe, bn)
    splits = max(1, min(tiles, max(triton.cdiv(4 * _sms(device), row_blocks), min(8, tiles // 8))))
    cols_per_split = triton.cdiv(tiles, splits) * bn
    return row_blocks, stripe, cols_per_split, triton.cdiv(stripe, cols_per_split)


def _stats_launch(rows, cols, scale, precision, config):
    m, c = rows.shape
    rows_arg, cols_arg, tma = _operands(rows, cols, config)

    shared = _shared_shift(rows)
    flags = torch.zeros((1,), dtype=torch.int32, device=rows.device)
    even = _even(m, cols.shape[0], config)  # stripes and splits are whole tiles: only the batch's edges are not

    def launch(programs, row_max, row_sum, col_max, col_sum, col_start, col_stop, cols_per_split):
        nonlocal flags
        if shared == 2 and flags.numel() < programs:
            flags = torch.zeros((programs,), dtype=torch.int32, device=rows.device)
        for mode, fixup in ((shared, False), (0, True)) if shared == 2 else ((shared, False),):
            _stats_kernel[(programs,)](
                rows_arg, cols_arg, scale, row_max, row_sum, col_max, col_sum,
                m, c, col_start, col_stop, cols_per_split,
                rows.stride(0), rows.stride(1), cols.stride(0), cols.stride(1),
                row_max.stride(0), col_max.stride(0), float(SHARED_SHIFT_SPREAD), flags,
                BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], PRECISION=precision,
                UPCAST=_upcast(rows), ROUND_TF32=_round_tf32_flag(rows, precision), TMA=tma, SHARED=mode,
                FIXUP=fixup, EVEN=even, num_warps=config["num_warps"], num_stages=config["num_stages"],
            )

    return _stats_by_stripes(m, cols.shape[0], config, rows.device, launch)


def _stats_by_stripes(m: int, n: int, config: dict, device, launch) -> tuple[torch.Tensor, torch.Tensor]:
    """Both directions' log-sum-exps ``(rows [m], cols [n])`` of a block, from a kernel with ``_stats_kernel``'s
    partials that ``launch(programs, row_max, row_sum, col_max, col_sum, col_start, col_stop, cols_per_split)``
    starts on each column stripe: the stripes' row partials merged into a running (max, sum), each stripe's column
    partials merged over the row blocks (base 2)."""
    row_blocks, stripe, cols_per_split, splits = _stripes(m, n, config, device, fields=2)
    row_max = torch.empty((splits, m), dtype=torch.float32, device=device)
    row_sum = torch.empty_like(row_max)
    col_max = torch.empty((row_blocks, stripe), dtype=torch.float32, device=device)
    col_sum = torch.empty_like(col_max)
    run_max = torch.full((m,), float("-inf"), dtype=torch.float32, device=device)
    run_sum = torch.zeros((m,), dtype=torch.float32, device=device)
    col_lse = torch.empty((n,), dtype=torch.float32, device=device)
    for col_start in range(0, n, stripe):
        col_stop = min(col_start + stripe, n)
        width = col_stop - col_start
        active = triton.cdiv(width, cols_per_split)
        launch(row_blocks * active, row_max, row_sum, col_max, col_sum, col_start, col_stop, cols_per_split)
        # rows: merge this stripe's splits into the running (max, sum), base 2
        part_max, part_sum = row_max[:active], row_sum[:active]
        new_max = torch.maximum(run_max, part_max.amax(0))
        run_sum = run_sum * torch.exp2(run_max - new_max) + (part_sum * torch.exp2(part_max - new_max)).sum(0)
        run_max = new_max
        # columns: merge the row blocks' partials; the stripe's columns are then complete
        c_max = col_max[:, :width].amax(0)
        c_sum = (col_sum[:, :width] * torch.exp2(col_max[:, :width] - c_max)).sum(0)
        col_lse[col_start:col_stop] = (c_max + torch.log2(c_sum)) / LOG2E
    return (run_max + torch.log2(run_sum)) / LOG2E, col_lse


def _round_tf32_flag(rows: torch.Tensor, precision: str) -> bool:
    return rows.dtype == torch.float32 and precision == "tf32"


def _block_sides(g_dtype: torch.dtype, m: int, n: int) -> tuple[int, int]:
    """Near-square blocks of at most ``G_BYTES`` of G (in ``g_dtype``): both GEMMs then have a long inner dimension
    and stay compute-bound at any b."""
    elements, align = G_BYTES // g_dtype.itemsize, G_ALIGN
    side = max(align, math.isqrt(elements) // align * align)
    block_m = min(side, triton.cdiv(m, align) * align)
    block_n = min(max(align, elements // block_m // align * align), triton.cdiv(n, align) * align)
    return block_m, block_n


def _g_format(rows: torch.Tensor, cols: torch.Tensor, dots, precision: str, bound: float):
    """How a kernel writes G and what cuBLAS multiplies it by: ``(g_dtype, g_scale, gemm_rows, gemm_cols)``. fp16
    features: G in fp16 times ``bound`` (the largest scale that keeps ``|G|`` in fp16's range). fp32 features whose
    values are narrower (``dots`` given, ``_dot_operands``) under ``tf32``: the same, with fp16 copies of the features
    for the GEMMs (``G_FP16``), where every feature is within fp16's range (one host sync: the largest magnitude).
    Else G in the features' dtype and the GEMMs on the features."""
    if rows.dtype == torch.float16:
        return torch.float16, bound, rows, cols
    narrower = dots is not None and dots[0].dtype != rows.dtype
    wanted = G_FP16 == "1" or (G_FP16 == "auto" and rows.is_cuda)
    if rows.dtype == torch.float32 and narrower and precision == "tf32" and wanted:
        largest = torch.stack([rows.abs().amax(), cols.abs().amax()]).amax() if rows.numel() and cols.numel() else 0
        if float(largest) <= FP16_MAX:
            return torch.float16, bound, dots[0].half(), dots[1].half()
    return rows.dtype, 1.0, rows, cols


def _g_blocks(rows, cols, config, fill, sums: int, precision: str, alpha=None, d_rows=None, d_cols=None,
              rows_out=None, write_g: bool = True, row_done=None, g_format=None):
    """Walk the ``rows x cols`` matrix block by block of G (at most ``G_BYTES``): ``fill(g_block,
    partials, row_start, row_stop, col_start, col_stop, programs)`` launches ``programs`` programs of a kernel
    that writes the block of G (times ``g_scale``) and ``sums`` fp32 partial sums per program; then, unless
    ``alpha`` is None, cuBLAS adds ``alpha * G @ cols`` into ``d_rows`` and ``alpha * G^T @ rows``
    into ``d_cols`` (fp32 out). With ``rows_out`` (instead of ``d_rows``) each row block's gradient
    is summed in an fp32 scratch and written to ``rows_out`` (any dtype) once complete. Without
    ``write_g`` no G buffer exists (the kernel writes only its sums). ``row_done(row_start,
    row_stop, row_grads)``, if given, receives each row block's gradient (an fp32 scratch) once
    complete, instead of ``d_rows``/``rows_out``. ``g_format``: ``_g_format``'s, else G in the features' dtype.
    Returns the ``[sums]`` totals of the partials (fp32)."""
    m, c = rows.shape
    n = cols.shape[0]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    if G_ALIGN % bm or G_ALIGN % bn:  # the block kernels leave G unmasked: no tile may reach into the next block
        raise ValueError(f"tiles of {bm} x {bn} do not divide the blocks of G ({G_ALIGN}-aligned): take tiles of at "
                         f"most {G_ALIGN} a side that divide it")
    g_dtype, _, gemm_rows, gemm_cols = g_format or (rows.dtype, 1.0, rows, cols)
    block_m, block_n = _block_sides(g_dtype, m, n)
    pitch = triton.cdiv(block_n, 8) * 8  # each row of a block 16-byte aligned, whatever its width (TMA's stores)
    g = torch.empty((block_m * pitch if write_g else 1,), dtype=g_dtype, device=rows.device)
    # zeros: a sum a kernel does not write stays 0 (the sigmoid kernel's without WRITE_G/SCALE_SUM)
    partials = torch.zeros((triton.cdiv(block_m, bm) * triton.cdiv(block_n, bn), sums), dtype=torch.float32,
                           device=rows.device)
    totals = torch.zeros((sums,), dtype=torch.float32, device=rows.device)
    for row_start in range(0, m, block_m):
        row_stop = min(row_start + block_m, m)
        if alpha is None:  # kernel only (the loss without gradients, tuning, profiling)
            row_grads = None
        elif rows_out is None and row_done is None:
            row_grads = d_rows[row_start:row_stop]
        else:
            row_grads = torch.zeros((row_stop - row_start, c), dtype=torch.float32, device=rows.device)
        for col_start in range(0, n, block_n):
            col_stop = min(col_start + block_n, n)
            height, width = row_stop - row_start, col_stop - col_start
            programs = _programs(triton.cdiv(height, bm) * triton.cdiv(width, bn), rows.device)
            g_block = g[: height * pitch].view(height, pitch)[:, :width] if write_g else g.view(1, 1)
            fill(g_block, partials, row_start, row_stop, col_start, col_stop, programs)
            totals += partials[:programs].sum(0)
            if alpha is not None:
                with fp32_matmul(precision):
                    _accumulate(row_grads, g_block, gemm_cols[col_start:col_stop], alpha)
                    _accumulate(d_cols[col_start:col_stop], g_block.T, gemm_rows[row_start:row_stop], alpha)
        if row_done is not None and alpha is not None:
            row_done(row_start, row_stop, row_grads)
        elif rows_out is not None and alpha is not None:
            rows_out[row_start:row_stop] = row_grads
    return totals


def _g_blocks_and_scale_sum(rows, cols, config, fill, sums: int, precision: str, alpha: float, d_rows, d_cols, scale,
                            g_format):
    """``_g_blocks`` with the gradients added into ``d_rows`` and ``d_cols`` (``alpha = scale * w / g_scale``), and
    ``w * sum(g * dots)`` taken from the row gradients: ``sum_i <rows_i, (scale * w * g @ cols)_i> / scale``, one
    ``[block, c]`` dot per row block instead of a product and a sum per logit in the kernel. Returns ``(the kernel's
    [sums] totals, that sum)``."""
    scale_sum = torch.zeros((), dtype=torch.float32, device=rows.device)

    def row_done(row_start, row_stop, row_grads):
        nonlocal scale_sum
        d_rows[row_start:row_stop] += row_grads
        scale_sum = scale_sum + (rows[row_start:row_stop].float() * row_grads).sum()

    totals = _g_blocks(rows, cols, config, fill, sums, precision, alpha, d_rows, d_cols, row_done=row_done,
                       g_format=g_format)
    return totals, scale_sum / scale


def _grad_launch(rows, cols, scale, row_lse, col_lse, diagonal, precision, config,
                 weight=None, d_rows=None, d_cols=None, rows_out=None, dots=None):
    """The softmax backward over ``_g_blocks``: the kernel writes ``G' = P_row + P_col - 2 I``,
    cuBLAS multiplies it into ``d_rows`` and ``d_cols``. Without ``weight`` (autotuning) only the
    kernel runs. ``dots``: the ``(rows, cols)`` the kernel takes its dot products of (copies in a
    narrower dtype holding the same values, ``_dot_operands``), else ``rows`` and ``cols``; G' and
    the GEMMs as ``_g_format`` says. Returns ``sum(G' * dots)`` (fp32, unweighted)."""
    c = rows.shape[1]
    dot_rows, dot_cols = dots or (rows, cols)
    g_format = _g_format(rows, cols, dots, precision, FP16_G_SCALE)  # |G'| <= 2
    g_scale = _power_of_two(g_format[1])
    alpha = None
    if weight is not None:
        # host sync: cuBLAS takes alpha as a number (once per block call, not per tile)
        alpha = float(scale.double() * weight.double()) / g_scale

    rows_arg, cols_arg, tma = _operands(dot_rows, dot_cols, config)

    def fill(g_block, partials, row_start, row_stop, col_start, col_stop, programs):
        g_arg, g_tma = _g_target(g_block, config, tma)
        _grad_kernel[(programs,)](
            rows_arg, cols_arg, scale, row_lse, col_lse, g_arg, partials,
            c, row_start, row_stop, col_start, col_stop, g_scale,
            dot_rows.stride(0), dot_rows.stride(1), dot_cols.stride(0), dot_cols.stride(1),
            g_block.stride(0), g_block.stride(1),
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], PRECISION=precision,
            DIAGONAL=diagonal, UPCAST=_upcast(dot_rows), GROUP_M=GROUP_ROWS,
            ROUND_TF32=_round_tf32_flag(dot_rows, precision), TMA=tma, G_TMA=g_tma, ACC_FLAG=_acc_flag(dot_rows),
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )

    return _g_blocks(rows, cols, config, fill, 1, precision, alpha, d_rows, d_cols, rows_out, g_format=g_format)[0]


def _sigmoid_launch(rows, cols, scale, bias, diagonal, precision, config, d_rows=None, d_cols=None,
                    grads: bool = True, write_g: bool | None = None, dots=None):
    """The sigmoid loss over ``_g_blocks``: the kernel writes ``g`` and the tile sums, cuBLAS
    multiplies ``g`` into ``d_rows``/``d_cols`` (``grads``). ``write_g`` (default: ``grads``)
    without ``grads``: the kernel alone, as the backward runs it (tuning). ``dots``: as in
    ``_grad_launch``. Returns ``[loss, d_scale, d_bias]`` sums (fp32)."""
    write_g = grads if write_g is None else write_g
    c = rows.shape[1]
    dot_rows, dot_cols = dots or (rows, cols)
    g_format = _g_format(rows, cols, dots, precision, FP16_G_SCALE) if write_g else None  # |g| <= 1
    g_scale = _power_of_two(g_format[1] if g_format else 1.0)
    alpha = float(scale.double()) / g_scale if grads else None  # host sync, once per block call

    rows_arg, cols_arg, tma = _operands(dot_rows, dot_cols, config)

    def fill(g_block, partials, row_start, row_stop, col_start, col_stop, programs):
        g_arg, g_tma = _g_target(g_block, config, tma)
        _sigmoid_kernel[(programs,)](
            rows_arg, cols_arg, scale, bias, g_arg, partials,
            c, row_start, row_stop, col_start, col_stop, 1.0 / g_scale,  # exact: a power of two
            dot_rows.stride(0), dot_rows.stride(1), dot_cols.stride(0), dot_cols.stride(1),
            g_block.stride(0), g_block.stride(1),
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], PRECISION=precision,
            DIAGONAL=diagonal, UPCAST=_upcast(dot_rows), GROUP_M=GROUP_ROWS,
            ROUND_TF32=_round_tf32_flag(dot_rows, precision),
            WRITE_G=write_g, SCALE_SUM=not grads, TMA=tma, G_TMA=g_tma, FAST_RCP=_ptx(dot_rows),
            ACC_FLAG=_acc_flag(dot_rows), EVEN=_even(row_stop - row_start, col_stop - col_start, config),
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )

    if not grads:
        return _g_blocks(rows, cols, config, fill, 3, precision, write_g=write_g, g_format=g_format)
    partial_sums, scale_sum = _g_blocks_and_scale_sum(rows, cols, config, fill, 3, precision, alpha, d_rows, d_cols,
                                                      scale, g_format)
    return torch.stack([partial_sums[0], scale_sum, partial_sums[2]])


def _distill_launch(rows, cols, t_rows, t_cols, scale, t_scale: float, lse, precision, config, weight=None,
                    d_rows=None, d_cols=None, dots=None, t_weight: float = 1.0, diagonal_weight: float | None = None,
                    diagonal_offset: int = 0, write_g: bool = True):
    """The distillation term's pass over ``_g_blocks``: the kernel writes ``G = P_row(S) + P_col(S) - t_weight
    (P_row(T) + P_col(T))`` (less ``2 diagonal_weight`` on the diagonal when given) and sums the teacher-weighted
    dots; with ``weight`` cuBLAS multiplies G by ``weight`` into ``d_rows`` and ``d_cols``. ``lse``: ``[m + n + m +
    n]`` (``_distill_grad_kernel``). ``dots``: as in ``_grad_launch``. Without ``weight`` and ``write_g`` the kernel
    writes no G (the term's value alone). Returns ``[sum((P_row(T) + P_col(T)) * dots), weight * sum(G * dots)]``
    (fp32; the second 0 without ``weight``)."""
    (m, c), n, ct = rows.shape, cols.shape[0], t_rows.shape[1]
    dot_rows, dot_cols = dots or (rows, cols)
    # |G| <= 2 + 2 t_weight + 2 diagonal_weight
    g_format = _g_format(rows, cols, dots, precision, FP16_G_SCALE / 4) if write_g else None
    g_scale = _power_of_two(g_format[1] if g_format else 1.0)
    alpha = None if weight is None else float(scale.double()) * weight / g_scale  # host sync, once

    rows_arg, cols_arg, t_rows_arg, t_cols_arg, tma = _student_and_teacher_operands(dot_rows, dot_cols, t_rows,
                                                                                    t_cols, config)

    def fill(g_block, partials, row_start, row_stop, col_start, col_stop, programs):
        g_arg, g_tma = _g_target(g_block, config, tma)
        _distill_grad_kernel[(programs,)](
            rows_arg, cols_arg, t_rows_arg, t_cols_arg, scale, float(t_scale), lse, g_arg, partials,
            m, n, c, ct, row_start, row_stop, col_start, col_stop, g_scale, float(t_weight),
            float(diagonal_weight or 0.0), int(diagonal_offset),
            dot_rows.stride(0), dot_rows.stride(1), dot_cols.stride(0), dot_cols.stride(1),
            t_rows.stride(0), t_rows.stride(1), t_cols.stride(0), t_cols.stride(1),
            g_block.stride(0), g_block.stride(1),
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], PRECISION=precision,
            UPCAST=_upcast(dot_rows), ROUND_TF32=_round_tf32_flag(dot_rows, precision),
            T_UPCAST=_upcast(t_rows), T_ROUND_TF32=_round_tf32_flag(t_rows, precision), GROUP_M=GROUP_ROWS,
            DIAGONAL=diagonal_weight is not None, TMA=tma, G_TMA=g_tma,
            EVEN=_even(row_stop - row_start, col_stop - col_start, config), WRITE_G=write_g,
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )

    if alpha is None:
        cross = _g_blocks(rows, cols, config, fill, 1, precision, write_g=write_g, g_format=g_format)[0]
        return torch.stack([cross, torch.zeros_like(cross)])
    # weight * sum(G * dots) from the row gradients, the kernel's one sum a logit left to the teacher-weighted dots
    cross, scale_sum = _g_blocks_and_scale_sum(rows, cols, config, fill, 1, precision, alpha, d_rows, d_cols, scale,
                                               g_format)
    return torch.stack([cross[0], scale_sum])


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out += alpha * a @ b`` with ``out`` fp32 and ``a``, ``b`` in the input dtype."""
    if a.dtype == torch.float32:
        out.addmm_(a, b, alpha=alpha)
    elif out.is_cuda:
        torch.addmm(out, a, b, alpha=alpha, out_dtype=torch.float32, out=out)
    else:  # CPU (the interpreter tests): no mixed-dtype GEMM there
        out.addmm_(a.float(), b.float(), alpha=alpha)


# ----------------------------------------------------------------------------------------------
# autograd.Function: the one-process symmetric loss on the kernels
# ----------------------------------------------------------------------------------------------
class _SymmetricLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, image_features, text_features, scale, fp32_precision):
        row_lse, col_lse = block_stats(image_features, text_features, scale, fp32_precision=fp32_precision)
        positives = (image_features.float() * text_features.float()).sum(1) * scale.float()
        ctx.save_for_backward(image_features, text_features, scale, row_lse, col_lse)
        ctx.fp32_precision = fp32_precision
        return (row_lse.sum() + col_lse.sum() - 2 * positives.sum()) / (2 * image_features.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        image_features, text_features, scale, row_lse, col_lse = ctx.saved_tensors
        weight = grad_output.float() / (2 * image_features.shape[0])
        d_image, d_text, d_scale = block_grads(image_features, text_features, scale, row_lse, col_lse,
                                               weight, True, fp32_precision=ctx.fp32_precision)
        return (d_image.to(image_features.dtype), d_text.to(text_features.dtype),
                d_scale.to(scale.dtype).reshape(scale.shape), None)


# ----------------------------------------------------------------------------------------------
# Functional API (the signatures of torch_tiles.py, less its ``tile``: the kernels size their own)
# ----------------------------------------------------------------------------------------------
def _check(rows: torch.Tensor, cols: torch.Tensor, precision: str) -> None:
    if rows.dtype not in (torch.bfloat16, torch.float16, torch.float32) or cols.dtype != rows.dtype:
        raise TypeError(f"Triton loss kernels take bf16, fp16 or fp32 features; got {rows.dtype}, {cols.dtype}")
    if rows.dim() != 2 or cols.dim() != 2 or rows.shape[1] != cols.shape[1]:
        raise ValueError(f"rows [m, c] and cols [n, c] expected; got {tuple(rows.shape)}, {tuple(cols.shape)}")
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"fp32_precision={precision!r}: use tf32 or ieee")
    if not (rows.is_cuda or interpreting()):
        raise RuntimeError("the Triton loss kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU); "
                           "use loss.impl=torch on this machine")


def _dot_operands(rows: torch.Tensor, cols: torch.Tensor, dots_dtype: torch.dtype | None):
    """The kernels' dot operands: ``rows`` and ``cols`` as given, or, with ``dots_dtype`` (bf16 or
    fp16) and fp32 inputs, copies in that dtype. The caller promises the fp32 values are that
    dtype's (the loss's ``values_in``): the copies are then exact, and so are their products
    in fp32, as TF32's or IEEE fp32's products of the same values are. Only the order of the fp32
    sums differs, and the tensor cores run at twice TF32's rate on half the bytes."""
    if dots_dtype is None or rows.dtype != torch.float32 or dots_dtype == torch.float32:
        return rows, cols
    if dots_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dots_dtype={dots_dtype}: bf16 or fp16 (the dtype the fp32 features' values are in)")
    return rows.to(dots_dtype), cols.to(dots_dtype)


def block_stats(
    rows: torch.Tensor, cols: torch.Tensor, scale: torch.Tensor, fp32_precision: str = "tf32",
    config: dict | None = None, dots_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column ``logsumexp`` of ``scale * rows @ cols^T``.

    rows: [m, c], cols: [n, c] (bf16, fp16 or fp32, same dtype), scale: [] (any float dtype).
    Returns ``(row_lse [m], col_lse [n])`` in fp32. One pass over the tiles. ``dots_dtype``:
    fp32 features whose values are bf16's (fp16's) are multiplied in that dtype (``_dot_operands``).
    """
    _check(rows, cols, fp32_precision)
    rows, cols = _dot_operands(rows, cols, dots_dtype)
    scale = scale.reshape(()).float()
    return _with_fitting_config("stats", rows, fp32_precision, cols.shape[0], config,
                                lambda config: _stats_launch(rows, cols, scale, fp32_precision, config))


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
    fp32_precision: str = "tf32",
    rows_dtype: torch.dtype | None = None,
    config: dict | None = None,
    dots_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``weight * (sum row_lse + sum col_lse - 2 [diagonal] sum_i S_ii)`` over the block.

    Shapes as in ``block_stats``; ``row_lse [m]``/``col_lse [n]`` fp32 over the whole matrix;
    ``weight []``. Returns ``(d_rows [m, c], d_cols [n, c], d_scale [])`` in fp32, accumulated
    into ``d_rows``/``d_cols`` when given (fp32, contiguous). ``rows_dtype`` (with ``d_rows``
    None): ``d_rows`` is returned in that dtype, each row block summed in fp32 and cast when
    complete, so no fp32 ``[m, c]`` buffer exists (the one-GPU loss returns it as is). ``dots_dtype``:
    as in ``block_stats`` (the kernel's dots only; G' and the GEMMs stay fp32).
    """
    _check(rows, cols, fp32_precision)
    operands = _dot_operands(rows, cols, dots_dtype)
    rows_out = None
    if d_rows is None and rows_dtype is not None:
        rows_out = torch.empty(rows.shape, dtype=rows_dtype, device=rows.device)
    elif d_rows is None:
        d_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    if d_cols is None:
        d_cols = torch.zeros(cols.shape, dtype=torch.float32, device=rows.device)
    weight, scale, row_lse, col_lse = (weight.reshape(()).float(), scale.reshape(()).float(),
                                       row_lse.float().contiguous(), col_lse.float().contiguous())
    dots = _with_fitting_config("grad", operands[0], fp32_precision, cols.shape[0], config, lambda config: _grad_launch(
        rows, cols, scale, row_lse, col_lse, diagonal, fp32_precision, config, weight, d_rows, d_cols, rows_out,
        operands))
    return (d_rows if rows_out is None else rows_out), d_cols, dots * weight


def sigmoid_block(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    diagonal: bool,
    d_rows: torch.Tensor | None = None,
    d_cols: torch.Tensor | None = None,
    fp32_precision: str = "tf32",
    config: dict | None = None,
    dots_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sigmoid loss of one block and its gradients in one pass (``torch_tiles.sigmoid_block``'s
    contract): returns ``(sum softplus(-z l), sum g * dots, sum g)`` in fp32 and, when ``d_rows`` /
    ``d_cols`` (fp32, contiguous) are given, adds ``scale * g @ cols`` / ``scale * g^T @ rows`` into
    them. Without either, only the loss kernel runs (no G is written). ``dots_dtype``: as in
    ``block_grads``."""
    _check(rows, cols, fp32_precision)
    operands = _dot_operands(rows, cols, dots_dtype)
    grads = d_rows is not None or d_cols is not None
    if grads and (d_rows is None or d_cols is None):
        raise ValueError("sigmoid_block: give both d_rows and d_cols, or neither")
    scale, bias = scale.reshape(()).float(), bias.reshape(()).float()
    sums = _with_fitting_config("sigmoid", operands[0], fp32_precision, cols.shape[0], config, lambda config: (
        _sigmoid_launch(rows, cols, scale, bias, diagonal, fp32_precision, config, d_rows, d_cols, grads,
                        dots=operands)))
    return sums[0], sums[1], sums[2]


def distill_stats(
    rows: torch.Tensor, cols: torch.Tensor, t_rows: torch.Tensor, t_cols: torch.Tensor, scale: torch.Tensor,
    t_scale: float, fp32_precision: str = "tf32", dots_dtype: torch.dtype | None = None, config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distillation term's statistics: the log-sum-exps of the student's logits ``S = scale * rows @ cols^T``
    and of the teacher's ``T = t_scale * t_rows @ t_cols^T`` (``t_rows [m, ct]``, ``t_cols [n, ct]``, any width
    ``ct``), each ``block_stats``' (one pass over that matrix's tiles, both directions): ``(rows [2, m], cols [2,
    n])``, the student's then the teacher's, fp32, as ``distill_block`` takes them. ``config``: both passes' tiles
    (else each its width's)."""
    student = block_stats(rows, cols, scale, fp32_precision, config, dots_dtype)
    teacher = block_stats(t_rows, t_cols, torch.tensor(float(t_scale), dtype=torch.float32, device=rows.device),
                          fp32_precision, config, dots_dtype)
    return torch.stack([student[0], teacher[0]]), torch.stack([student[1], teacher[1]])


def distill_block(
    rows: torch.Tensor, cols: torch.Tensor, t_rows: torch.Tensor, t_cols: torch.Tensor, scale: torch.Tensor,
    t_scale: float, row_lse: torch.Tensor, col_lse: torch.Tensor, weight: float | None = None,
    d_rows: torch.Tensor | None = None, d_cols: torch.Tensor | None = None, fp32_precision: str = "tf32",
    dots_dtype: torch.dtype | None = None, config: dict | None = None, contrastive_weight: float = 0.0,
    diagonal_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distillation term of the student's logits ``S = scale * rows @ cols^T`` against the teacher's ``T =
    t_scale * t_rows @ t_cols^T`` (``t_rows [m, ct]``, ``t_cols [n, ct]``, any width ``ct``) over the block, both
    directions, in one pass over the tiles, given each matrix's log-sum-exps over the whole matrix (``row_lse [2,
    m]``, ``col_lse [2, n]``: the student's, then the teacher's; ``distill_stats``'). Returns ``(cross,
    d_scale)``: ``cross = sum((P_row(T) + P_col(T)) * S)``, the teacher-weighted student logits summed over the rows
    and the columns (the term's cross-entropies are the student's log-sum-exps less it), and the scale's gradient.
    With ``weight`` the same pass adds the gradients of ``weight`` x those cross-entropies, ``weight * scale * G @
    cols`` into ``d_rows [m, c]`` and ``weight * scale * G^T @ rows`` into ``d_cols [n, c]`` (fp32, contiguous), ``G
    = P_row(S) + P_col(S) - P_row(T) - P_col(T)``, and ``d_scale = weight * sum(G * rows @ cols^T)`` (else 0). With
    ``contrastive_weight`` too, the gradient of ``contrastive_weight`` x the contrastive loss's ``sum row_lse + sum
    col_lse - 2 sum S_i,i+offset`` (``block_grads``'; row ``i``'s positive in column ``i + diagonal_offset``: a
    rank's rows against every rank's columns), whose log-sum-exps are the student's. ``dots_dtype``: as in
    ``block_stats``, for the student's and the teacher's operands."""
    _check(rows, cols, fp32_precision)
    _check(t_rows, t_cols, fp32_precision)
    operands = _dot_operands(rows, cols, dots_dtype)
    t_rows, t_cols = _dot_operands(t_rows, t_cols, dots_dtype)
    lse = torch.cat([row_lse[0], col_lse[0], row_lse[1], col_lse[1]]).float().contiguous()
    scale = scale.reshape(()).float()
    both = 0.0 if weight is None else float(weight) + float(contrastive_weight)
    t_weight, diagonal_weight = 1.0, None
    if both != 0.0:  # G's student part carries both weights: the others relative to it
        t_weight = float(weight) / both
        diagonal_weight = float(contrastive_weight) / both if contrastive_weight else None
        if d_rows is None or d_cols is None:
            raise ValueError("distill_block: with a weight, give d_rows and d_cols")
    sums = _with_fitting_config("distill_grad", operands[0], fp32_precision, cols.shape[0], config, lambda config: (
        _distill_launch(rows, cols, t_rows, t_cols, scale, t_scale, lse, fp32_precision, config,
                        both if both != 0.0 else None, d_rows, d_cols, operands, t_weight, diagonal_weight,
                        diagonal_offset, write_g=both != 0.0)))
    return sums[0] * scale, sums[1]


def symmetric_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor,
    fp32_precision: str = "tf32",
) -> torch.Tensor:
    """``(CE(S) + CE(S^T)) / 2`` with ``S = scale * image @ text^T``, positives on the diagonal.

    image_features, text_features: [b, c] (bf16, fp16 or fp32); scale: []. Returns a fp32 scalar;
    differentiable in all three inputs. One process; ``losses.InfClLoss`` runs the ring.
    """
    return _SymmetricLoss.apply(image_features, text_features, scale, fp32_precision)
