"""Loss values of fp32 features against float64: cuBLAS TF32 beside the Triton kernels' TF32 dots
(operands rounded to nearest) and exact fp32 dots, for the softmax (infcl) and sigmoid (siglip) losses.

    python scripts/benchmarks/precision.py --out precision.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import write_results

from megabatch.kernels import triton_tiles
from megabatch.losses import clip_loss_reference, siglip_loss_reference


def rel(value, truth: float) -> float:
    return abs(float(value) / truth - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1000,4096,12345")
    parser.add_argument("--dims", default="100,768,1024")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for b in map(int, args.batches.split(",")):
        for c in map(int, args.dims.split(",")):
            generator = torch.Generator().manual_seed(b + c)
            images = F.normalize(torch.randn(b, c, generator=generator, dtype=torch.float64), dim=-1)
            texts = F.normalize(images + torch.randn(b, c, generator=generator, dtype=torch.float64), dim=-1)
            images, texts = images.float().cuda(), texts.float().cuda()
            scale = torch.tensor(100.0, device="cuda")
            sig_scale, sig_bias = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
            truth = float(clip_loss_reference(images.double(), texts.double(), scale.double()))
            sig_truth = float(siglip_loss_reference(images.double(), texts.double(), sig_scale.double(),
                                                    sig_bias.double()))
            torch.backends.cuda.matmul.allow_tf32 = True
            row = {"batch": b, "dim": c, "scale": 100.0, "siglip_scale": 10.0, "siglip_bias": -10.0,
                   "softmax_cublas_tf32": rel(clip_loss_reference(images, texts, scale), truth)}
            for precision in ("tf32", "ieee"):
                row[f"softmax_triton_{precision}"] = rel(
                    triton_tiles.symmetric_loss(images, texts, scale, fp32_precision=precision), truth)
                row[f"sigmoid_triton_{precision}"] = rel(triton_tiles.sigmoid_block(
                    images, texts, sig_scale, sig_bias, True, fp32_precision=precision)[0] / b, sig_truth)
            row["sigmoid_cublas_tf32"] = rel(siglip_loss_reference(images, texts, sig_scale, sig_bias), sig_truth)
            print(row, flush=True)
            results.append(row)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
