"""Variants of the loss's forward (``stats``) and backward (``grad``) kernels on one block, against the tree's own
kernels (``today``) on the same inputs, one GPU: tiles loaded through TMA tensor descriptors (``tma``), the column loop
flattened with the feature loop (``_flat``), the backward's kernel persistent with 1 or 2 programs per SM (``_w1``,
``_w2``), Triton's warp specialisation (``_ws``), and the forward's loop without its softmax (``tma_gemm_only``, the
GEMM's ceiling in that loop). Each variant's largest difference from the tree's kernel is recorded (a variant is a
copy of the kernel's math with another way of loading and looping). Writes JSON (``--out``).

    python scripts/benchmarks/loss_variants.py --size 131072 --c 512 --out loss_variants.json

The measurement behind c0d9abb (``docs/bench/loss_variants_c512_h200.json``, ``today`` = 68c2fcd's kernels).

``--kinds distill_stats`` (until 2026-12-06; ``git show b2806a0:scripts/benchmarks/loss_variants.py``) timed the
distillation term's former statistics kernel, both matrices' tiles in one loop, against its two GEMMs alone and its
softmax alone; that kernel is gone (the statistics are ``_stats_kernel``'s, one matrix a pass).

``--kinds grad_parts``: where the backward's G' kernel spends its time, on one block of G' at ``PARTS_CONFIGS``' tiles:
the tree's launcher (``tree``), a copy of its kernel (``today_copy``), one exponential a logit instead of two
(``one_exp``: ``2^(s - h) (2^(h - r) + 2^(h - c))``, ``h`` the tile's largest log-sum-exp), the GEMM and the store of G'
without the softmax (``gemm_store``), the GEMM alone (``gemm_only``), and G' stored by each thread instead of through a
tensor descriptor (``today_ptr``; ``_evict``: marked to leave L2 first). ``docs/bench/grad_parts_c512_h100.json``,
``grad_stores_c512_h100.json`` (and ``_c768_``): on an H100 the GEMM alone reaches 80% of the bf16 peak at 128 x 256,
54% with the store and 42% with the softmax; the kernel's best tile (64 x 128, two programs an SM) 44.5%.

    python scripts/benchmarks/loss_variants.py --kinds grad_parts --size 131072 --c 512 --out grad_parts.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from bench import write_results  # noqa: E402

from megabatch.kernels import triton_tiles as tt  # noqa: E402
from megabatch.kernels.triton_tiles import (  # noqa: E402
    _block_tile,
    _block_tiles,
    _dot_tile,
    _power_of_two_parts,
    _store_g,
)


@triton.jit
def _stats_tma(rows_desc, cols_desc, scale_ptr, row_max_ptr, row_sum_ptr, col_max_ptr, col_sum_ptr,
               m, c, col_start, col_stop, cols_per_split, stride_row_part, stride_col_part,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               FLATTEN: tl.constexpr, WS: tl.constexpr, GEMM_ONLY: tl.constexpr):
    pid = tl.program_id(0)
    splits = tl.num_programs(0) // tl.cdiv(m, BLOCK_M)
    pid_m, pid_s = pid // splits, pid % splits
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < m
    scale2 = tl.load(scale_ptr).to(tl.float32) * 1.4426950408889634
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    split_start = col_start + pid_s * cols_per_split
    split_stop = tl.minimum(split_start + cols_per_split, col_stop)
    for j0 in tl.range(split_start, split_stop, BLOCK_N, flatten=FLATTEN, warp_specialize=WS):
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, c, BLOCK_K):
            a = rows_desc.load([pid_m * BLOCK_M, k0])
            b = cols_desc.load([j0, k0])
            acc = tl.dot(a, b.T, acc)
        offs_n = j0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < split_stop
        if GEMM_ONLY:
            l_i += tl.sum(acc, 1)
        else:
            s = tl.where(col_ok[None, :], acc * scale2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
            s_col = tl.where(row_ok[:, None], s, float("-inf"))
            c_max = tl.where(col_ok, tl.max(s_col, 0), 0.0)
            c_sum = tl.sum(tl.exp2(s_col - c_max[None, :]), 0)
            part = pid_m.to(tl.int64) * stride_col_part + offs_n - col_start
            tl.store(col_max_ptr + part, c_max, mask=col_ok)
            tl.store(col_sum_ptr + part, c_sum, mask=col_ok)
    row_part = pid_s.to(tl.int64) * stride_row_part + offs_m
    tl.store(row_max_ptr + row_part, m_i, mask=row_ok)
    tl.store(row_sum_ptr + row_part, l_i, mask=row_ok)


def stats_variant(rows, cols, scale, config, flatten=False, ws=False, gemm_only=False):
    """``_stats_tma`` over the stripes as the tree's own forward runs its kernel (``_stats_by_stripes``)."""
    m, c = rows.shape
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    rows_desc = TensorDescriptor.from_tensor(rows, [bm, bk])
    cols_desc = TensorDescriptor.from_tensor(cols, [bn, bk])

    def launch(programs, row_max, row_sum, col_max, col_sum, col_start, col_stop, cols_per_split):
        _stats_tma[(programs,)](
            rows_desc, cols_desc, scale, row_max, row_sum, col_max, col_sum,
            m, c, col_start, col_stop, cols_per_split, row_max.stride(0), col_max.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FLATTEN=flatten, WS=ws, GEMM_ONLY=gemm_only,
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )

    return tt._stats_by_stripes(m, cols.shape[0], config, rows.device, launch)


@triton.jit
def _grad_tma(rows_desc, cols_desc, scale_ptr, row_lse_ptr, col_lse_ptr, g_ptr, dscale_ptr,
              c, row_start, row_stop, col_start, col_stop, g_scale, stride_gm, stride_gn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    """Persistent: program p takes tiles p, p + PROGRAMS, ... of the block (grouped order)."""
    pid = tl.program_id(0)
    tiles, grid_n = _block_tiles(row_start, row_stop, col_start, col_stop, BLOCK_M, BLOCK_N)
    scale2 = tl.load(scale_ptr).to(tl.float32) * 1.4426950408889634
    dscale = 0.0
    for t in tl.range(pid, tiles, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        m0, n0, offs_m, offs_n, row_ok, col_ok = _block_tile(t, grid_n, row_start, row_stop, col_start, col_stop,
                                                             BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, c, BLOCK_K):
            a = rows_desc.load([m0, k0])
            b = cols_desc.load([n0, k0])
            acc = tl.dot(a, b.T, acc)
        row_lse2 = tl.load(row_lse_ptr + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
        col_lse2 = tl.load(col_lse_ptr + offs_n, mask=col_ok, other=0.0) * 1.4426950408889634
        s = acc * scale2
        g = tl.exp2(s - row_lse2[:, None]) + tl.exp2(s - col_lse2[None, :])
        g = tl.where(offs_m[:, None] == offs_n[None, :], g - 2.0, g)
        g = tl.where(row_ok[:, None] & col_ok[None, :], g, 0.0)
        dscale += tl.sum(g * acc)
        g_offs = (offs_m - row_start).to(tl.int64)[:, None] * stride_gm + (offs_n - col_start)[None, :] * stride_gn
        tl.store(g_ptr + g_offs, (g * g_scale).to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    tl.store(dscale_ptr + pid, dscale)


def grad_variant(rows, cols, scale, row_lse, col_lse, g_block, partials, config, waves=1, flatten=False, ws=False):
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    height, width = g_block.shape
    tiles = triton.cdiv(height, bm) * triton.cdiv(width, bn)
    programs = min(tiles, waves * torch.cuda.get_device_properties(rows.device).multi_processor_count)
    _grad_tma[(programs,)](
        TensorDescriptor.from_tensor(rows, [bm, bk]), TensorDescriptor.from_tensor(cols, [bn, bk]),
        scale, row_lse, col_lse, g_block, partials, rows.shape[1], 0, height, 0, width, tt.FP16_G_SCALE,
        g_block.stride(0), g_block.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PROGRAMS=programs, FLATTEN=flatten, WS=ws,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return partials[:programs].sum()


def grad_today(rows, cols, scale, row_lse, col_lse, g_block, partials, config):
    height, width = g_block.shape
    programs = triton.cdiv(height, config["BLOCK_M"]) * triton.cdiv(width, config["BLOCK_N"])
    tt._grad_kernel[(programs,)](
        rows, cols, scale, row_lse, col_lse, g_block, partials,
        rows.shape[1], 0, height, 0, width, tt.FP16_G_SCALE,
        rows.stride(0), rows.stride(1), cols.stride(0), cols.stride(1), g_block.stride(0), g_block.stride(1),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], PRECISION="tf32",
        DIAGONAL=True, UPCAST=False, GROUP_M=8, ROUND_TF32=False,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return partials[:programs].sum()


@triton.jit
def _grad_parts(rows_ptr, cols_ptr, scale_ptr, row_lse_ptr, col_lse_ptr, g_ptr, dscale_ptr, flags_ptr,
                c, row_start, row_stop, col_start, col_stop, g_scale, stride_gm, stride_gn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                UPCAST: tl.constexpr, STORE: tl.constexpr):
    """The backward's G' kernel as the tree has it (persistent, TMA loads and stores, g_scale in the exponents),
    ``MODE`` 0; 1: one exponential a logit, ``G' = 2^(s - h) (2^(h - r) + 2^(h - c))`` with ``h`` the tile's largest
    log-sum-exp (a tile whose log-sum-exps span more than 88 is flagged: its terms would leave fp32's normal range);
    2: no exponential (``G' = s``), the GEMM and the store; 3: the GEMM alone (no store). ``STORE`` 0: through the
    tensor descriptor (the tree's); 1: by each thread from its registers; 2: the same, marked to leave L2 first (G' is
    read back only after the whole block is written, and evicts the operands' tiles from L2 on its way)."""
    tiles, grid_n = _block_tiles(row_start, row_stop, col_start, col_stop, BLOCK_M, BLOCK_N)
    scale2 = tl.load(scale_ptr).to(tl.float32) * 1.4426950408889634
    g_shift, inv_g_scale = _power_of_two_parts(g_scale)
    dscale = tl.zeros((BLOCK_M,), tl.float32)
    bad = False
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        m0, n0, offs_m, offs_n, row_ok, col_ok = _block_tile(t, grid_n, row_start, row_stop, col_start, col_stop,
                                                             BLOCK_M, BLOCK_N, 8)
        acc = _dot_tile(rows_ptr, cols_ptr, m0, n0, offs_m, offs_n, row_ok, col_ok, c, 0, 0, 0, 0,
                        BLOCK_M, BLOCK_N, BLOCK_K, "tf32", UPCAST, False, True)
        if MODE == 3:
            dscale += tl.sum(acc, 1)
        else:
            s = acc * scale2
            if MODE == 2:
                g = s
            else:
                row_lse2 = tl.load(row_lse_ptr + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634 - g_shift
                col_lse2 = tl.load(col_lse_ptr + offs_n, mask=col_ok, other=0.0) * 1.4426950408889634 - g_shift
                if MODE == 0:
                    g = tl.exp2(s - row_lse2[:, None]) + tl.exp2(s - col_lse2[None, :])
                else:
                    h = tl.maximum(tl.max(row_lse2, 0), tl.max(col_lse2, 0))
                    low = tl.minimum(tl.min(row_lse2, 0), tl.min(col_lse2, 0))
                    bad = bad | (h - low > 88.0)
                    u = tl.exp2(h - row_lse2)
                    v = tl.exp2(h - col_lse2)
                    g = tl.exp2(s - h) * (u[:, None] + v[None, :])
                g = tl.where(offs_m[:, None] == offs_n[None, :], g - 2.0 * g_scale, g)
            dscale += tl.sum(g * acc, 1)
            if STORE == 0:
                _store_g(g_ptr, g, m0, n0, offs_m, offs_n, row_ok[:, None] & col_ok[None, :], row_start, col_start,
                         stride_gm, stride_gn, True)
            else:
                g_at = g_ptr + (offs_m - row_start).to(tl.int64)[:, None] * stride_gm + (offs_n - col_start)[None, :]
                tl.store(g_at, g.to(g_ptr.dtype.element_ty), eviction_policy="evict_first" if STORE == 2 else "")
    tl.store(dscale_ptr + tl.program_id(0), tl.sum(dscale, 0) * inv_g_scale)
    tl.store(flags_ptr + tl.program_id(0), bad.to(tl.int32))


def grad_parts(rows, cols, scale, row_lse, col_lse, g_block, partials, flags, config, mode, store=0):
    height, width = g_block.shape
    rows_arg, cols_arg, tma = tt._operands(rows, cols, config)
    g_arg = tt._g_target(g_block, config, tma)[0] if store == 0 else g_block
    programs = tt._programs(triton.cdiv(height, config["BLOCK_M"]) * triton.cdiv(width, config["BLOCK_N"]),
                            rows.device)
    _grad_parts[(programs,)](
        rows_arg, cols_arg, scale, row_lse, col_lse, g_arg, partials, flags,
        rows.shape[1], 0, height, 0, width, tt.FP16_G_SCALE, g_block.stride(0), g_block.stride(1),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], MODE=mode,
        UPCAST=tt._upcast(rows), STORE=store, num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return partials[:programs].sum()


GRAD_MODES = {"today_copy": (0, 0), "one_exp": (1, 0), "gemm_store": (2, 0), "gemm_only": (3, 0),
              "today_ptr": (0, 1), "today_ptr_evict": (0, 2), "gemm_store_ptr_evict": (2, 2)}


def cfg(bm, bn, bk, warps, stages):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


CONFIGS = [cfg(128, 64, 64, 4, 3), cfg(128, 64, 64, 4, 4), cfg(64, 128, 64, 4, 3), cfg(128, 128, 64, 8, 3),
           cfg(128, 128, 64, 4, 3), cfg(128, 256, 64, 8, 3), cfg(256, 128, 64, 8, 3), cfg(128, 128, 128, 8, 2)]
PARTS_CONFIGS = [cfg(64, 128, 64, 4, 4), cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 4, 2), cfg(128, 128, 32, 4, 4),
                 cfg(128, 128, 32, 4, 3), cfg(128, 256, 32, 8, 4), cfg(64, 256, 64, 4, 3), cfg(64, 256, 32, 4, 4),
                 cfg(128, 128, 64, 4, 4)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=131072)
    p.add_argument("--c", type=int, default=512)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="")
    p.add_argument("--kinds", default="stats,grad", help="of stats, grad, grad_parts")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    peak = 989e12
    n, c = args.size, args.c
    rows = torch.nn.functional.normalize(torch.randn(n, c, device=dev), dim=-1).bfloat16()
    cols = torch.nn.functional.normalize(torch.randn(n, c, device=dev), dim=-1).bfloat16()
    scale = torch.tensor(30.0, device=dev)
    today = tt.get_config("stats", rows, "tf32", n)
    ref_row, ref_col = tt._stats_launch(rows, cols, scale, "tf32", today)
    results = []

    def write() -> None:  # after every row: a run cut short keeps what it measured
        write_results(args.out, results, size=n, c=c, block=list(tt._block_sides(torch.float16, n, n)), peak=peak,
                      log2_size=math.log2(n))

    def record(kind, variant, config, fn, flops, check=None):
        try:
            out = fn()
            err = check(out) if check else None
            ms = do_bench(fn, warmup=3, rep=30)
        except Exception as error:  # noqa: BLE001
            results.append({"kind": kind, "variant": variant, "config": config, "error": f"{type(error).__name__}: "
                            + str(error)[:300]})
            print(kind, variant, config, "ERROR", type(error).__name__, str(error)[:200], flush=True)
            write()
            return
        tf = flops / (ms / 1e3)
        results.append({"kind": kind, "variant": variant, "config": config, "ms": ms, "tflops": tf / 1e12,
                        "peak_share": tf / peak, "max_err": err})
        print(f"{kind:6s} {variant:18s} {config} {ms:8.3f} ms {tf / 1e12:6.1f} TFLOP/s {tf / peak:.3f} err={err}",
              flush=True)
        write()

    def stats_check(out):
        return max(float((out[0] - ref_row).abs().max()), float((out[1] - ref_col).abs().max()))

    if "stats" in kinds:
        flops = 2.0 * n * n * c
        record("stats", "today", today, lambda: tt._stats_launch(rows, cols, scale, "tf32", today), flops, stats_check)
        variants = [("tma", {}), ("tma_flat", {"flatten": True}), ("tma_ws", {"ws": True}),
                    ("tma_gemm_only", {"gemm_only": True})]
        for config in CONFIGS:
            for name, kw in variants:
                if args.only and name not in args.only.split(","):
                    continue
                check = None if kw.get("gemm_only") else stats_check
                record("stats", name, config,
                       lambda kw=kw, config=config: stats_variant(rows, cols, scale, config, **kw), flops, check)
    block_m, block_n = tt._block_sides(torch.float16, n, n)
    if "grad" in kinds:
        # grad: one block of G' as the 1M line's backward writes it
        g_block = torch.empty((block_m, block_n), dtype=torch.float16, device=dev)
        g_ref = torch.empty_like(g_block)
        partials = torch.zeros((triton.cdiv(block_m, 64) * triton.cdiv(block_n, 64), 1), device=dev)
        gtoday = tt.get_config("grad", rows, "tf32", n)
        r, cc = rows[:block_m], cols[:block_n]
        gflops = 2.0 * block_m * block_n * c
        ref_sum = float(grad_today(r, cc, scale, ref_row, ref_col, g_ref, partials, gtoday))

        def grad_check(out):
            return max(float((g_block.float() - g_ref.float()).abs().max()), abs(float(out) - ref_sum) / abs(ref_sum))

        record("grad", "today", gtoday, lambda: grad_today(r, cc, scale, ref_row, ref_col, g_block, partials, gtoday),
               gflops, grad_check)
        gvariants = [("tma_w1", {}), ("tma_w2", {"waves": 2}), ("tma_w1_flat", {"flatten": True}),
                     ("tma_w2_flat", {"waves": 2, "flatten": True}), ("tma_w1_ws", {"ws": True})]
        for config in CONFIGS:
            for name, kw in gvariants:
                if args.only and name not in args.only.split(","):
                    continue
                record("grad", name, config, lambda kw=kw, config=config: grad_variant(
                    r, cc, scale, ref_row, ref_col, g_block, partials, config, **kw), gflops, grad_check)
    if "grad_parts" in kinds:
        # the backward's G' kernel taken apart on one block: the tree's kernel, a copy (MODE 0), one exponential a
        # logit (1), the GEMM and the store without exponentials (2), the GEMM alone (3)
        g_block = torch.empty((block_m, block_n), dtype=torch.float16, device=dev)
        g_ref = torch.empty_like(g_block)
        partials = torch.zeros((triton.cdiv(block_m, 64) * triton.cdiv(block_n, 64), 1), device=dev)
        flags = torch.zeros((triton.cdiv(block_m, 64) * triton.cdiv(block_n, 64),), dtype=torch.int32, device=dev)
        r, cc = rows[:block_m], cols[:block_n]
        gflops = 2.0 * block_m * block_n * c
        gtoday = tt.get_config("grad", rows, "tf32", n)
        ref_sum = float(grad_parts(r, cc, scale, ref_row, ref_col, g_ref, partials, flags, gtoday, 0))

        def parts_check(out):
            assert int(flags.max()) == 0, "a tile flagged"
            return max(float((g_block.float() - g_ref.float()).abs().max()), abs(float(out) - ref_sum) / abs(ref_sum))

        record("grad_parts", "tree", gtoday, lambda: tt._grad_launch(r, cc, scale, ref_row, ref_col, True, "tf32",
                                                                     gtoday), gflops)
        for config in PARTS_CONFIGS:
            for name, (mode, store) in GRAD_MODES.items():
                if args.only and name not in args.only.split(","):
                    continue
                record("grad_parts", name, config, lambda config=config, mode=mode, store=store: grad_parts(
                    r, cc, scale, ref_row, ref_col, g_block, partials, flags, config, mode, store), gflops,
                    parts_check if mode < 2 else None)


if __name__ == "__main__":
    main()
