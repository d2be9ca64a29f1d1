"""The towers' attention, side by side: PyTorch's SDPA (cuDNN / flash, on the strided q/k/v views of
the packed projection, as ``model.direct_attention`` calls it; eager and compiled by inductor, which
fuses the views' gradients into the packed layout) against the project's Triton kernels
on the packed projection (``model.attention=triton``), forward and forward + backward, per shape.

    python scripts/benchmarks/attention.py --out attention_h100.json
    python scripts/benchmarks/attention.py --shapes 512x197x12x64 --dtype bf16 --out attention_b16.json
    python scripts/benchmarks/attention.py --tune --out attention_tune.json

``--tune`` first times every kernel at each candidate tile (query rows, key rows, warps, stages), one
kernel at a time with the others at their defaults, checks each candidate's result against the
default's, and then compares SDPA with the kernels at each shape's fastest tiles.

A shape is ``batch x length x heads x head_dim`` (``c`` at the end: causal). Useful TFLOP/s: the
forward's two GEMMs, ``4 b h s^2 d`` (half with the causal mask), and 2.5 times that for the
backward's five; a time is the median of ``--repeat`` CUDA-event timings after ``--warmup`` calls.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from bench import gpu_time, write_results

from megabatch.kernels import attention
from megabatch.kernels.attention import packed_attention, packed_attention_backward, packed_attention_op

# ViT-B/16 and ViT-L/14 (224 px) image towers at their sub-batch, ViT-L/14 at 336 px, ViT-bigG-14, the text towers
SHAPES = ["512x197x12x64", "256x257x16x64", "128x577x16x64", "128x257x16x104", "512x77x8x64c", "512x77x12x64c",
          "512x50x12x64"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse(shape: str) -> tuple[int, int, int, int, bool]:
    causal = shape.endswith("c")
    batch, length, heads, head_dim = (int(x) for x in shape.rstrip("c").split("x"))
    return batch, length, heads, head_dim, causal


def sdpa(qkv: torch.Tensor, causal: bool) -> torch.Tensor:
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [b, h, s, d] views, as DirectAttentionBlock
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).flatten(2)


def triton_packed(qkv: torch.Tensor, causal: bool) -> torch.Tensor:
    return packed_attention(qkv, causal).flatten(2)


COMPILED_SDPA = torch.compile(sdpa, dynamic=False)


CANDIDATES = {
    "forward": [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128, 256) for w in (4, 8) for st in (2, 3, 4)],
    "dkdv": [(m, n, w, st) for m in (16, 32, 64) for n in (64, 128) for w in (4, 8) for st in (2, 3, 4)],
    "dq": [(m, n, w, st) for m in (64, 128) for n in (16, 32, 64) for w in (4, 8) for st in (2, 3, 4)],
}


def tune(shape: str, dtype: torch.dtype, warmup: int, repeat: int) -> tuple[list[dict], dict]:
    """Each kernel's time at each candidate tile of ``shape``; the fastest per kernel."""
    batch, length, heads, head_dim, causal = parse(shape)
    generator = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(batch, length, 3, heads, head_dim, device="cuda", dtype=dtype, generator=generator)
    grad = torch.randn(batch, length, heads, head_dim, device="cuda", dtype=dtype, generator=generator)
    dim = 64 if head_dim <= 64 else 128
    out, lse = packed_attention_op(qkv, causal)
    reference = {"forward": out.float(), "backward": packed_attention_backward(grad, qkv, out, lse, causal).float()}
    rows, best = [], {}
    for kernel, candidates in CANDIDATES.items():
        default = attention.TILES[kernel][dim]
        results = []
        for tiles in candidates:
            attention.TILES[kernel][dim] = tiles
            row = {"shape": shape, "dtype": str(dtype), "kernel": kernel, "tiles": list(tiles)}
            try:
                if kernel == "forward":
                    run = lambda: packed_attention_op(qkv, causal)  # noqa: E731
                    got = run()[0].float()
                else:
                    run = lambda: packed_attention_backward(grad, qkv, out, lse, causal)  # noqa: E731
                    got = run().float()
                want = reference["forward" if kernel == "forward" else "backward"]
                row["rel_diff"] = float((got - want).norm() / want.norm())
                row["ms"] = gpu_time(run, warmup, repeat) * 1e3
                if row["rel_diff"] < 1e-2:
                    results.append((row["ms"], tiles))
            except Exception as error:  # noqa: BLE001 - a tile that cannot compile (shared memory) is a row
                row["error"] = str(error)[:300]
            rows.append(row)
        attention.TILES[kernel][dim] = default
        best[kernel] = min(results)[1] if results else default
        print(f"{shape:>16} {kernel:>8}: default {default} -> best {best[kernel]} "
              f"({min(results)[0]:.3f} ms)" if results else f"{shape} {kernel}: no candidate ran", flush=True)
    return rows, best


def launch_cost(fn, calls: int = 50) -> float:
    """CPU seconds per call to enqueue ``fn`` (the GPU kept busy by a long matmul first, so that no
    call waits for it): what a step pays on the host where its kernels are short."""
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(4):
        busy @ busy  # ~5 ms of GPU work queued ahead
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return seconds


def measure(shape: str, dtype: torch.dtype, warmup: int, repeat: int) -> list[dict]:
    batch, length, heads, head_dim, causal = parse(shape)
    generator = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(batch, length, 3, heads, head_dim, device="cuda", dtype=dtype, generator=generator)
    grad = torch.randn(batch, length, heads * head_dim, device="cuda", dtype=dtype, generator=generator)
    flops = 4 * batch * heads * length * length * head_dim * (0.5 if causal else 1.0)
    rows, outputs = [], {}
    # sdpa-compiled: inductor fuses the views' gradient into the packed layout, as model.compile does
    # (eager, autograd assembles q, k and v's gradients with copies that a compiled block does not make)
    for name, fn in (("sdpa", sdpa), ("sdpa-compiled", COMPILED_SDPA), ("triton", triton_packed)):
        leaf = qkv.clone().requires_grad_()
        try:
            forward = gpu_time(lambda fn=fn: fn(qkv, causal), warmup, repeat)

            def forward_backward(fn=fn, leaf=leaf):
                leaf.grad = None
                fn(leaf, causal).backward(grad)

            both = gpu_time(forward_backward, warmup, repeat)
            host = {"forward_host_us": launch_cost(lambda fn=fn: fn(qkv, causal)) * 1e6,
                    "forward_backward_host_us": launch_cost(forward_backward) * 1e6}
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run this shape is a row too
            rows.append({"shape": shape, "dtype": str(dtype), "kernel": name, "error": str(error)[:500]})
            continue
        outputs[name] = (fn(qkv, causal).float(), leaf.grad.float())
        backward = max(both - forward, 1e-9)
        rows.append({"shape": shape, "batch": batch, "length": length, "heads": heads, "head_dim": head_dim,
                     "causal": causal, "dtype": str(dtype), "kernel": name, "forward_ms": forward * 1e3,
                     "backward_ms": backward * 1e3, "forward_tflops": flops / forward / 1e12,
                     "backward_tflops": 2.5 * flops / backward / 1e12, **host})
    if "sdpa" in outputs and "triton" in outputs:  # the two agree (bf16 rounding apart)
        for row in rows:
            if row["kernel"] == "triton":
                for index, part in enumerate(("out", "grad")):
                    want, got = outputs["sdpa"][index], outputs["triton"][index]
                    row[f"{part}_rel_diff_vs_sdpa"] = float((got - want).norm() / want.norm())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--tune", action="store_true", help="time candidate tiles first; compare at the best")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py times GPU kernels and needs a CUDA GPU")
    rows = []
    for shape in args.shapes.split(","):
        dim = 64 if parse(shape)[3] <= 64 else 128
        defaults = {kernel: table[dim] for kernel, table in attention.TILES.items()}
        if args.tune:
            tuned, best = tune(shape, DTYPES[args.dtype], args.warmup, args.repeat)
            rows += tuned
            for kernel, tiles in best.items():
                attention.TILES[kernel][dim] = tiles
        measured = [dict(row, tiles={k: list(t[dim]) for k, t in attention.TILES.items()})
                    for row in measure(shape, DTYPES[args.dtype], args.warmup, args.repeat)]
        rows += measured
        for kernel, tiles in defaults.items():
            attention.TILES[kernel][dim] = tiles
        for row in measured:
            print(json.dumps(row), flush=True)
        write_results(args.out, rows)
    for shape in args.shapes.split(","):
        pair = {row["kernel"]: row for row in rows if row["shape"] == shape and "forward_ms" in row}
        if "sdpa" in pair and "triton" in pair:
            compiled = pair.get("sdpa-compiled", pair["sdpa"])
            print(f"{shape:>16}  forward {pair['sdpa']['forward_ms'] / pair['triton']['forward_ms']:.2f}x  "
                  f"backward {pair['sdpa']['backward_ms'] / pair['triton']['backward_ms']:.2f}x  "
                  f"(against compiled SDPA {compiled['forward_ms'] / pair['triton']['forward_ms']:.2f}x / "
                  f"{compiled['backward_ms'] / pair['triton']['backward_ms']:.2f}x)  "
                  f"(triton {pair['triton']['forward_tflops']:.0f} / {pair['triton']['backward_tflops']:.0f} "
                  f"TFLOP/s, sdpa {pair['sdpa']['forward_tflops']:.0f} / {pair['sdpa']['backward_tflops']:.0f}; host "
                  f"us per forward + backward: triton {pair['triton']['forward_backward_host_us']:.0f}, "
                  f"sdpa {pair['sdpa']['forward_backward_host_us']:.0f})")


if __name__ == "__main__":
    main()
