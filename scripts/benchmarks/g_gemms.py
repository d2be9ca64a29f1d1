"""The loss backward's GEMMs on G' (``G' @ cols``, ``G'^T @ rows``) in each dtype G' could be written in: time, TFLOP/s
and relative error against float64, side by side on one GPU.

    python scripts/benchmarks/g_gemms.py --sides 13824,19456 --dims 512,768 --out g_gemms.json

G' is a real one: ``P_row + P_col - 2 I`` of ``scale * rows @ cols^T`` for normalized bf16 features, one block of the
backward's size (``triton_tiles.G_BYTES``: sides of 14080 in fp32 and 19968 in fp16 at 768 MiB, 17152 x 17408 and
24576 since). Routes: ``tf32`` (fp32 G', the features fp32 holding bf16 values: GradCache's loss before the fp16
route), ``fp32_ieee``, ``fp16_scaled`` (G' times ``FP16_G_SCALE`` in fp16, fp16 copies of the features: today's route
for those features), ``bf16`` (bf16 features' route), ``bf16_split`` (G' as two bf16 parts, two GEMMs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from bench import gpu_time, write_results  # noqa: E402

from megabatch.kernels.torch_tiles import fp32_matmul  # noqa: E402
from megabatch.kernels.triton_tiles import FP16_G_SCALE  # noqa: E402


def routes(g: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, transpose: bool) -> dict:
    """Each route's product as a function: ``G' @ cols`` (``G'^T @ rows`` when ``transpose``), fp32 out."""
    other = rows if transpose else cols  # bf16
    g16, g_hi = (g * FP16_G_SCALE).half(), g.bfloat16()
    g_lo = (g - g_hi.float()).bfloat16()
    if transpose:
        g, g16, g_hi, g_lo = g.T, g16.T, g_hi.T, g_lo.T
    other32, other16 = other.float(), other.half()

    def fp32(precision: str):
        with fp32_matmul(precision):  # cuBLAS's fp32 GEMM in TF32 or exact, as the loss's backward sets it
            return torch.mm(g, other32)

    def split():
        out = torch.mm(g_hi, other, out_dtype=torch.float32)
        return torch.addmm(out, g_lo, other, out_dtype=torch.float32, out=out)

    return {"tf32": lambda: fp32("tf32"), "fp32_ieee": lambda: fp32("ieee"),
            "fp16_scaled": lambda: torch.mm(g16, other16, out_dtype=torch.float32) / FP16_G_SCALE,
            "bf16": lambda: torch.mm(g_hi, other, out_dtype=torch.float32), "bf16_split": split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", default="13824,19456")
    parser.add_argument("--dims", default="512,768")
    parser.add_argument("--scale", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls a route (the median is reported)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for c in (int(c) for c in args.dims.split(",")):
        for side in (int(s) for s in args.sides.split(",")):
            generator = torch.Generator(device="cuda").manual_seed(0)
            rows = F.normalize(torch.randn(side, c, device="cuda", generator=generator), dim=-1).bfloat16()
            cols = F.normalize(rows.float() + 0.8 * torch.randn(side, c, device="cuda", generator=generator),
                               dim=-1).bfloat16()
            logits = args.scale * rows.float() @ cols.float().T
            g = torch.softmax(logits, 1) + torch.softmax(logits, 0)
            del logits
            g.diagonal().sub_(2.0)
            for transpose in (False, True):
                exact = (g.double().T @ rows.double()) if transpose else (g.double() @ cols.double())
                for route, fn in routes(g, rows, cols, transpose).items():
                    error = fn().double() - exact
                    seconds = gpu_time(fn, 1, args.repeats)
                    results.append({"dim": c, "side": side, "product": "G'^T @ rows" if transpose else "G' @ cols",
                                    "route": route, "time_s": seconds, "tflops": 2 * side * side * c / seconds / 1e12,
                                    "relative_error": float(error.norm() / exact.norm()),
                                    "relative_max_error": float(error.abs().max() / exact.abs().max())})
                    print(results[-1], flush=True)
                    write_results(args.out, results, scale=args.scale)
                del exact
            del g
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
