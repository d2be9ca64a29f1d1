"""The towers' attention, side by side: PyTorch's SDPA (cuDNN / flash, on the strided q/k/v views of
the packed projection, as ``model.direct_attention`` calls it) against the project's Triton kernels
on the packed projection (``model.attention=triton``), forward and forward + backward, per shape.

    python scripts/benchmarks/attention.py --out attention_h100.json
    python scripts/benchmarks/attention.py --shapes 512x197x12x64 --dtype bf16 --out attention_b16.json

A shape is ``batch x length x heads x head_dim`` (``c`` at the end: causal). Useful TFLOP/s: the
forward's two GEMMs, ``4 b h s^2 d`` (half with the causal mask), and 2.5 times that for the
backward's five; a time is the median of ``--repeat`` CUDA-event timings after ``--warmup`` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from common import write_results

from megabatch.kernels.attention import packed_attention

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


def timed(fn, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(shape: str, dtype: torch.dtype, warmup: int, repeat: int) -> list[dict]:
    batch, length, heads, head_dim, causal = parse(shape)
    generator = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(batch, length, 3, heads, head_dim, device="cuda", dtype=dtype, generator=generator)
    grad = torch.randn(batch, length, heads * head_dim, device="cuda", dtype=dtype, generator=generator)
    flops = 4 * batch * heads * length * length * head_dim * (0.5 if causal else 1.0)
    rows, outputs = [], {}
    for name, fn in (("sdpa", sdpa), ("triton", triton_packed)):
        leaf = qkv.clone().requires_grad_()
        try:
            forward = timed(lambda fn=fn: fn(qkv, causal), warmup, repeat)

            def forward_backward(fn=fn, leaf=leaf):
                leaf.grad = None
                fn(leaf, causal).backward(grad)

            both = timed(forward_backward, warmup, repeat)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run this shape is a row too
            rows.append({"shape": shape, "dtype": str(dtype), "kernel": name, "error": str(error)[:500]})
            continue
        outputs[name] = (fn(qkv, causal).float(), leaf.grad.float())
        backward = max(both - forward, 1e-9)
        rows.append({"shape": shape, "batch": batch, "length": length, "heads": heads, "head_dim": head_dim,
                     "causal": causal, "dtype": str(dtype), "kernel": name, "forward_ms": forward * 1e3,
                     "backward_ms": backward * 1e3, "forward_tflops": flops / forward / 1e12,
                     "backward_tflops": 2.5 * flops / backward / 1e12})
    if len(outputs) == 2:  # the two agree (bf16 rounding apart)
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
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        rows += measure(shape, DTYPES[args.dtype], args.warmup, args.repeat)
        for row in rows[-2:]:
            print(json.dumps(row), flush=True)
        write_results(args.out, rows)
    for shape in args.shapes.split(","):
        pair = {row["kernel"]: row for row in rows if row["shape"] == shape and "forward_ms" in row}
        if len(pair) == 2:
            print(f"{shape:>16}  forward {pair['sdpa']['forward_ms'] / pair['triton']['forward_ms']:.2f}x  "
                  f"backward {pair['sdpa']['backward_ms'] / pair['triton']['backward_ms']:.2f}x  "
                  f"(triton {pair['triton']['forward_tflops']:.0f} / {pair['triton']['backward_tflops']:.0f} "
                  f"TFLOP/s, sdpa {pair['sdpa']['forward_tflops']:.0f} / {pair['sdpa']['backward_tflops']:.0f})")


if __name__ == "__main__":
    main()
