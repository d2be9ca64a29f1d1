"""The towers' MLP, side by side: ``c_proj(gelu(c_fc(x)))`` as open_clip computes it (cuBLAS GEMMs and
PyTorch's GELU kernel, eager), the same compiled by inductor (cuBLAS plus inductor's fused GELU and
bias kernels, as ``model.compile=true`` runs it), and ``kernels/mlp.py`` (``model.fused_mlp=true``: the
exact GELU in the first GEMM's epilogue and its derivative in the hidden gradient's), forward and
forward + backward, per shape, bf16.

    python scripts/benchmarks/mlp.py --out mlp_h100.json
    python scripts/benchmarks/mlp.py --shapes 100864x768x3072 --out mlp_b16.json

A shape is ``tokens x width x hidden`` (tokens: sub-batch x sequence length). TFLOP/s: the two GEMMs,
``4 M E H`` forward, twice that backward; times are medians of CUDA-event timings. Also written: each
output's and gradient's difference from the eager module's.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from common import gpu_time, write_results

from megabatch.kernels.mlp import fused_mlp

# ViT-B/16 (512 images x 197), ViT-L/14 (256 x 257), ViT-B/16's text tower (512 captions x 32)
SHAPES = ["100864x768x3072", "65792x1024x4096", "16384x512x2048"]


def eager(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def measure(shape: str, warmup: int, repeat: int) -> list[dict]:
    tokens, width, hidden = (int(v) for v in shape.split("x"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *size, scale=1.0: (torch.randn(*size, device="cuda", generator=generator) * scale  # noqa: E731
                                     ).bfloat16().requires_grad_()
    tensors = [make(tokens, width), make(hidden, width, scale=width ** -0.5), make(hidden),
               make(width, hidden, scale=hidden ** -0.5), make(width)]
    grad = torch.randn(tokens, width, device="cuda", generator=generator).bfloat16()
    flops = 4 * tokens * width * hidden
    implementations = {"eager": eager, "inductor": torch.compile(eager), "fused": fused_mlp}
    rows, results = [], {}
    for name, fn in implementations.items():
        def forward(fn=fn):
            with torch.no_grad():
                return fn(*tensors)

        def forward_backward(fn=fn):
            for tensor in tensors:
                tensor.grad = None
            fn(*tensors).backward(grad)

        try:
            forward_s = gpu_time(forward, warmup, repeat)
            both_s = gpu_time(forward_backward, warmup, repeat)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run a shape is a row too
            rows.append({"shape": shape, "impl": name, "error": str(error)[:500]})
            continue
        forward_backward()
        results[name] = [forward().float()] + [t.grad.float() for t in tensors]
        backward_s = max(both_s - forward_s, 1e-9)
        rows.append({"shape": shape, "tokens": tokens, "width": width, "hidden": hidden, "impl": name,
                     "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
                     "forward_tflops": flops / forward_s / 1e12, "backward_tflops": 2 * flops / backward_s / 1e12})
    for row in rows:
        if row.get("impl") in results and "eager" in results and row["impl"] != "eager":
            for part, want, got in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), results["eager"], results[row["impl"]],
                                       strict=True):
                row[f"{part}_rel_diff_vs_eager"] = float((got - want).norm() / want.norm())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mlp.py times GPU kernels and needs a CUDA GPU")
    rows = []
    for shape in args.shapes.split(","):
        rows += measure(shape, args.warmup, args.repeat)
        for row in rows[-3:]:
            print(json.dumps(row), flush=True)
        write_results(args.out, rows)
    for shape in args.shapes.split(","):
        by = {row["impl"]: row for row in rows if row["shape"] == shape and "forward_ms" in row}
        if "fused" in by and "inductor" in by:
            inductor, fused = by["inductor"], by["fused"]
            print(f"{shape:>18}  fused against inductor: forward {inductor['forward_ms'] / fused['forward_ms']:.2f}x"
                  f"  backward {inductor['backward_ms'] / fused['backward_ms']:.2f}x")


if __name__ == "__main__":
    main()
