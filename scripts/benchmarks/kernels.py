"""Where the Triton loss kernels spend their time: forward stats kernel, backward G' kernel and
the cuBLAS gradient GEMMs, each timed alone on one GPU, as achieved TFLOP/s of the work each does.

    python scripts/benchmarks/kernels.py --batches 32k,128k --dims 512,768 --dtypes bf16,fp32 --out prof.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from common import write_results

from megabatch.config import parse_count
from megabatch.kernels import triton_tiles

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run compiles / warms up
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times[1:])


def profile(b: int, c: int, dtype: torch.dtype, precision: str) -> dict:
    rows = F.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype)
    cols = F.normalize(torch.randn(b, c, device="cuda"), dim=-1).to(dtype)
    scale, weight = torch.tensor(100.0, device="cuda"), torch.tensor(1.0 / (2 * b), device="cuda")
    row_lse, col_lse = triton_tiles.block_stats(rows, cols, scale, fp32_precision=precision)
    grad_config = triton_tiles.get_config("grad", rows, precision)
    d_rows, d_cols = torch.zeros(b, c, device="cuda"), torch.zeros(b, c, device="cuda")
    stats_s = timed(lambda: triton_tiles.block_stats(rows, cols, scale, fp32_precision=precision))
    g_kernel_s = timed(lambda: triton_tiles._grad_launch(rows, cols, scale, row_lse, col_lse, True, precision,
                                                        grad_config))
    grads_s = timed(lambda: triton_tiles.block_grads(rows, cols, scale, row_lse, col_lse, weight, True,
                                                    d_rows, d_cols, fp32_precision=precision))
    gemm_s = grads_s - g_kernel_s
    flop = 2 * b * b * c
    return {"batch": b, "dim": c, "dtype": str(dtype).removeprefix("torch."), "fp32_precision": precision,
            "stats_kernel_s": stats_s, "stats_tflops": flop / stats_s / 1e12,
            "g_kernel_s": g_kernel_s, "g_kernel_tflops": flop / g_kernel_s / 1e12,
            "gemms_s": gemm_s, "gemms_tflops": 2 * flop / gemm_s / 1e12,
            "total_s": stats_s + grads_s, "useful_tflops": 3 * flop / (stats_s + grads_s) / 1e12,
            "stats_config": triton_tiles.get_config("stats", rows, precision), "grad_config": grad_config}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32k,128k")
    parser.add_argument("--dims", default="768")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--fp32-precision", default="tf32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for dtype in args.dtypes.split(","):
        for c in (int(d) for d in args.dims.split(",")):
            for b in (parse_count(x, "--batches") for x in args.batches.split(",")):
                row = profile(b, c, DTYPES[dtype], args.fp32_precision)
                print(json.dumps(row), flush=True)
                results.append(row)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
