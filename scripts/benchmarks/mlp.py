"""The towers' MLP, side by side: ``c_proj(gelu(c_fc(x)))`` as open_clip computes it (cuBLAS GEMMs and
PyTorch's GELU kernel, eager), the same compiled by inductor (cuBLAS plus inductor's fused GELU and
bias kernels, as ``model.compile=true`` runs it), and ``kernels/mlp.py`` (``model.fused_mlp=true``: the
exact GELU in the first GEMM's epilogue and its derivative in the hidden gradient's), forward and
forward + backward, per shape, bf16.

    python scripts/benchmarks/mlp.py --out mlp_h100.json
    python scripts/benchmarks/mlp.py --shapes 100864x768x3072 --out mlp_b16.json
    python scripts/benchmarks/mlp.py --tune --out mlp_tune.json

``--tune`` first times the fused GEMM alone at each candidate tile (``kernels.mlp.TILES``), with its
two epilogues (``gelu``: ``z`` and ``gelu(z)``; ``gelu-nograd``: ``gelu(z)`` only; ``gelu_grad``), beside
what it replaces: cuBLAS's GEMM with its bias (``addmm``), that plus inductor's GELU kernel, cuBLASLt's
tanh-GELU epilogue (``torch._addmm_activation``), and cuBLAS's ``dy @ w2`` plus inductor's
``gelu_backward``; then compares the MLPs at the fastest tiles.

A shape is ``tokens x width x hidden`` (tokens: sub-batch x sequence length). TFLOP/s: the two GEMMs,
``4 M E H`` forward, twice that backward; times are medians of CUDA-event timings. Also written: each
output's and gradient's difference from the eager module's.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from common import gpu_time, kernel_arguments, print_speedups, time_forward_backward, write_results

from megabatch.kernels import mlp
from megabatch.kernels.mlp import GELU, GELU_GRAD, fused_mlp

# ViT-B/16 (512 images x 197), ViT-L/14 (256 x 257), ViT-B/16's text tower (512 captions x 32)
SHAPES = ["100864x768x3072", "65792x1024x4096", "16384x512x2048"]


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)
CANDIDATES = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4),
              (128, 128, 32, 8, 4, 4), (128, 128, 128, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4),
              (256, 128, 64, 8, 8, 3), (128, 256, 32, 8, 8, 4), (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4),
              (64, 256, 64, 8, 8, 4), (128, 128, 64, 16, 8, 3)]


def tune(shape: str, warmup: int, repeat: int) -> tuple[list[dict], tuple]:
    """The fused GEMM's time per epilogue at each candidate tile, beside the kernels it replaces; the
    tiles fastest for the forward and backward epilogues together."""
    tokens, width, hidden = (int(v) for v in shape.split("x"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, width, device="cuda", generator=generator).bfloat16()
    w1 = (torch.randn(hidden, width, device="cuda", generator=generator) * width ** -0.5).bfloat16()
    b1 = torch.randn(hidden, device="cuda", generator=generator).bfloat16()
    w2 = (torch.randn(width, hidden, device="cuda", generator=generator) * hidden ** -0.5).bfloat16()
    dy = torch.randn(tokens, width, device="cuda", generator=generator).bfloat16()
    z = F.linear(x, w1, b1)
    flops = 2 * tokens * width * hidden
    gelu_after = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)))
    gelu_backward = torch.compile(lambda dy, w2, z: torch.ops.aten.gelu_backward(dy @ w2, z))
    references = {"addmm": lambda: F.linear(x, w1, b1), "addmm+gelu (inductor)": lambda: gelu_after(x, w1, b1),
                  "cublaslt tanh-gelu epilogue": lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True),
                  "mm+gelu_backward (inductor)": lambda: gelu_backward(dy, w2, z)}
    rows = []
    for name, fn in references.items():
        ms = gpu_time(fn, warmup, repeat) * 1e3
        rows.append({"shape": shape, "impl": name, "ms": ms, "tflops": flops / ms / 1e9})
        print(f"{shape:>18} {name:>28}: {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    want = {"gelu": F.gelu(z.float()), "gelu_grad": torch.ops.aten.gelu_backward((dy @ w2).float(), z.float())}
    runs = {"gelu": lambda: mlp._gemm(x, w1.t(), GELU, bias=b1),
            "gelu-nograd": lambda: mlp._gemm(x, w1.t(), GELU, bias=b1, store_z=False),
            "gelu_grad": lambda: mlp._gemm(dy, w2, GELU_GRAD, aux=z)}
    default, totals = mlp.TILES, {}
    for tiles in CANDIDATES:
        mlp.TILES = tiles
        for epilogue, run in runs.items():
            row = {"shape": shape, "impl": f"fused {epilogue}", "tiles": list(tiles)}
            try:
                got = run()[0].float()
                reference = want["gelu_grad" if epilogue == "gelu_grad" else "gelu"]
                row["rel_diff"] = float((got - reference).norm() / reference.norm())
                row["ms"] = gpu_time(run, warmup, repeat) * 1e3
                row["tflops"] = flops / row["ms"] / 1e9
                if row["rel_diff"] < 2e-2 and epilogue != "gelu-nograd":
                    totals.setdefault(tiles, []).append(row["ms"])
            except Exception as error:  # noqa: BLE001 - a tile that cannot compile (shared memory) is a row
                row["error"] = str(error)[:300]
            rows.append(row)
            print(f"{shape:>18} {row['impl']:>28} {tiles}: " + (f"{row['ms']:.3f} ms  {row['tflops']:.0f} TFLOP/s"
                  f"  rel diff {row['rel_diff']:.1e}" if "ms" in row else row["error"][:120]), flush=True)
    mlp.TILES = default
    complete = {tiles: sum(ms) for tiles, ms in totals.items() if len(ms) == 2}
    best = min(complete, key=complete.get) if complete else default
    print(f"{shape:>18} best tiles {best} (gelu + gelu_grad {complete.get(best, float('nan')):.3f} ms)", flush=True)
    return rows, best


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
        try:
            forward_s, backward_s, results[name] = time_forward_backward(fn, tensors, grad, warmup, repeat)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run a shape is a row too
            rows.append({"shape": shape, "impl": name, "error": str(error)[:500]})
            continue
        rows.append({"shape": shape, "tokens": tokens, "width": width, "hidden": hidden, "impl": name,
                     "tiles": list(mlp.TILES) if name == "fused" else None,
                     "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
                     "forward_tflops": flops / forward_s / 1e12, "backward_tflops": 2 * flops / backward_s / 1e12})
    for row in rows:
        if row.get("impl") in results and "eager" in results and row["impl"] != "eager":
            for part, want, got in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), results["eager"], results[row["impl"]],
                                       strict=True):
                row[f"{part}_rel_diff_vs_eager"] = float((got - want).norm() / want.norm())
    return rows


def main() -> None:
    args = kernel_arguments(__doc__, SHAPES, 20, "mlp.py")
    rows = []
    for shape in args.shapes.split(","):
        if args.tune:
            tuned, best = tune(shape, args.warmup, args.repeat)
            rows += tuned
            mlp.TILES = best
        rows += measure(shape, args.warmup, args.repeat)
        for row in rows[-3:]:
            print(json.dumps(row), flush=True)
        write_results(args.out, rows)
    print_speedups(rows, args.shapes.split(","))


if __name__ == "__main__":
    main()
