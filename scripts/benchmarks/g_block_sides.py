"""How large the loss backward's blocks of G' should be: cuBLAS's two GEMMs on one block (``G' @ x`` and ``G'^T @ x``,
16-bit in, accumulated into fp32 as the backward does) at each side, then the whole backward (``block_grads``: the G'
kernel and the GEMMs, block by block) with blocks of each side, one GPU.

    python scripts/benchmarks/g_block_sides.py --sides 2560,16384,18944,19968,24576,25344 \\
        --backward-sides 16384,24576 --out g_block_sides.json

The backward's rows: ``default`` is the tree's own block (``triton_tiles.G_BYTES``, which ``MEGABATCH_LOSS_G_MIB``
sets), the others blocks of that side (at most the batch). ``--batches``: ``b:c:dtype`` triples (``bf16``, or
``fp32_bf16_values``: GradCache's fp32 features holding bf16 values, G' in fp16). Share of the bf16 peak: the GEMMs'
FLOPs (``2 side^2 c`` each), the backward's three GEMMs' worth (``6 b^2 c``). Behind ``G_BYTES = 1152 MiB``
(``docs/bench/g_sides_h100.json``, written by this script's first form).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from bench import write_results  # noqa: E402

from megabatch.config import parse_count  # noqa: E402
from megabatch.kernels import triton_tiles as tt  # noqa: E402

PEAK_BF16 = 989e12  # H100 and H200, dense


def timed(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up, in seconds (the median of ``bench.gpu_time`` would not
    match the measurements this script's first form made)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", default="2560,15872,16384,16896,18944,19968,20480,24576,25344")
    parser.add_argument("--dims", default="512,768")
    parser.add_argument("--backward-sides", default="16384,18944,24576", help="besides the tree's own blocks")
    parser.add_argument("--batches", default="256k:512:bf16,256k:768:bf16,1M:512:fp32_bf16_values")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []

    def emit(row: dict) -> None:
        results.append(row)
        print(row, flush=True)
        write_results(args.out, results, g_bytes=tt.G_BYTES)

    for c in (int(c) for c in args.dims.split(",")):
        for side in (int(s) for s in args.sides.split(",")):
            g = torch.randn(side, side, device="cuda").bfloat16()
            x = torch.randn(side, c, device="cuda").bfloat16()
            acc = torch.zeros(side, c, device="cuda")
            for name, left in (("G' @ x", g), ("G'^T @ x", g.T)):
                seconds = timed(partial(torch.addmm, acc, left, x, alpha=0.5, out_dtype=torch.float32, out=acc),
                                args.repeats + 2)
                emit({"kind": "gemm", "dim": c, "side": side, "product": name, "time_s": seconds,
                      "peak_share": 2 * side * side * c / seconds / PEAK_BF16})
            del g, x, acc
    own = tt._block_sides
    for spec in args.batches.split(","):
        batch, c, dtype = spec.split(":")
        b, c = parse_count(batch, "--batches"), int(c)
        generator = torch.Generator(device="cuda").manual_seed(0)
        image = F.normalize(torch.randn(b, c, device="cuda", generator=generator), dim=-1)
        text = F.normalize(image + 0.8 * torch.randn(b, c, device="cuda", generator=generator), dim=-1)
        rows, cols, dots = image.bfloat16(), text.bfloat16(), None
        if dtype == "fp32_bf16_values":
            rows, cols, dots = rows.float(), cols.float(), torch.bfloat16
        del image, text
        scale, weight = torch.tensor(100.0, device="cuda"), torch.tensor(1.0 / (2 * b), device="cuda")
        lse = tt.block_stats(rows, cols, scale, dots_dtype=dots)
        for side in [None, *(int(s) for s in args.backward_sides.split(","))]:
            tt._block_sides = own if side is None else (lambda g_dtype, m, n, side=side: (min(side, m), min(side, n)))
            try:
                seconds = timed(partial(tt.block_grads, rows, cols, scale, *lse, weight, True, dots_dtype=dots),
                                args.repeats if b < 2**20 else 1)
            finally:
                tt._block_sides = own
            emit({"kind": "backward", "batch": b, "dim": c, "dtype": dtype,
                  "side": "default" if side is None else side, "blocks": list(own(torch.float16, b, b)) if side is None
                  else [side, side], "time_s": seconds, "peak_share": 6 * b * b * c / seconds / PEAK_BF16})
        del rows, cols, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
