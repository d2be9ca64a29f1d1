"""A block's residual add and the LayerNorm after it, side by side: ``s = x + y``, ``out = LN(s)`` as
open_clip computes it under autocast (the add, then the norm in fp32 cast back to bf16; eager
PyTorch), the same compiled by inductor (its fused kernels, as ``model.compile=true`` runs them), and
``kernels/layernorm.py`` (one pass each way, dweight and dbias in the backward's pass); forward
without autograd, and the backward with gradients into both outputs; per shape, bf16.

    python scripts/benchmarks/layernorm.py --out layernorm_h100.json
    python scripts/benchmarks/layernorm.py --tune --out layernorm_tune_h100.json

``--tune`` first times each kernel alone at candidate block sizes, warps and (backward) programs per SM
(``kernels.layernorm.TILES``, ``BACKWARD_PROGRAMS_PER_SM``), on every shape; then compares at the
candidates fastest over all shapes together.

A shape is ``tokens x width`` (tokens: sub-batch x sequence length). These kernels are memory-bound:
beside the times, each row gives the bandwidth the pass reached on the least it must move (forward:
read x and y, write s and out; backward: read s, dout and ds, write dx), and a ``copy`` row moves the
same bytes with one clone, the GPU's practical ceiling. Also written: each output's and gradient's
difference from eager's.
"""

from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F
from common import gpu_time, kernel_arguments, print_speedups, time_forward_backward, write_results

from megabatch.kernels import layernorm
from megabatch.kernels.layernorm import add_layer_norm, add_layer_norm_backward, add_layer_norm_op

# ViT-B/16 image tower (512 images x 197), ViT-L/14 (256 x 257), ViT-bigG-14 (128 x 257), the text towers
# of ViT-B/16 and ViT-L/14 (512 captions x 32)
SHAPES = ["100864x768", "65792x1024", "32896x1664", "16384x512", "16384x768"]
EPS = 1e-5
FORWARD_CANDIDATES = [(elements, warps) for elements in (1024, 2048, 4096, 8192) for warps in (2, 4, 8)]
BACKWARD_CANDIDATES = [(elements, warps, per_sm) for elements in (1024, 2048) for warps in (4, 8)
                       for per_sm in (4, 8, 16, 32)]


def tune(shapes: list[str], warmup: int, repeat: int) -> list[dict]:
    """Each kernel's time alone per candidate and shape; sets the candidates with the least total time
    over the shapes (each shape's time relative to its best, summed)."""
    rows = []
    for shape in shapes:
        tokens, width = (int(v) for v in shape.split("x"))
        x, y, ds, dout = (torch.randn(tokens, width, device="cuda").bfloat16() for _ in range(4))
        weight, bias = torch.rand(width, device="cuda") + 0.5, torch.rand(width, device="cuda") - 0.5
        forward = functools.partial(add_layer_norm_op, x, y, weight, bias, EPS)
        s, _, mean, rstd = forward()
        backward = functools.partial(add_layer_norm_backward, dout, ds, s, weight, mean, rstd)
        for tiles in FORWARD_CANDIDATES:
            layernorm.TILES["forward"] = tiles
            ms = gpu_time(forward, warmup, repeat) * 1e3
            rows.append({"shape": shape, "kernel": "forward", "tiles": list(tiles), "ms": ms})
        for elements, warps, per_sm in BACKWARD_CANDIDATES:
            layernorm.TILES["backward"], layernorm.BACKWARD_PROGRAMS_PER_SM = (elements, warps), per_sm
            ms = gpu_time(backward, warmup, repeat) * 1e3
            rows.append({"shape": shape, "kernel": "backward", "tiles": [elements, warps, per_sm], "ms": ms})
        print(f"tuned {shape}", flush=True)
    timed = list(rows)
    for kernel in ("forward", "backward"):
        best = {shape: min(r["ms"] for r in timed if r["shape"] == shape and r["kernel"] == kernel) for shape in shapes}
        score: dict[tuple, float] = {}
        for row in timed:
            if row["kernel"] == kernel:
                score[tuple(row["tiles"])] = score.get(tuple(row["tiles"]), 0.0) + row["ms"] / best[row["shape"]]
        chosen = min(score, key=score.get)
        print(f"{kernel}: best tiles {chosen} ({score[chosen] / len(shapes):.3f}x the best per shape)", flush=True)
        if kernel == "forward":
            layernorm.TILES["forward"] = chosen
        else:
            layernorm.TILES["backward"], layernorm.BACKWARD_PROGRAMS_PER_SM = chosen[:2], chosen[2]
        rows.append({"kernel": kernel, "chosen": list(chosen), "mean_relative_to_best": score[chosen] / len(shapes)})
    return rows


def eager(x, y, weight, bias):
    s = x + y
    return s, F.layer_norm(s.float(), (s.shape[-1],), weight, bias, EPS).to(s.dtype)  # open_clip under autocast


def fused(x, y, weight, bias):
    return add_layer_norm(x, y, weight, bias, EPS)


def measure(shape: str, warmup: int, repeat: int) -> list[dict]:
    tokens, width = (int(v) for v in shape.split("x"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, width, device="cuda", generator=generator).bfloat16().requires_grad_()
    y = torch.randn(tokens, width, device="cuda", generator=generator).bfloat16().requires_grad_()
    weight = (1 + torch.randn(width, device="cuda", generator=generator) / 4).requires_grad_()
    bias = (torch.randn(width, device="cuda", generator=generator) / 4).requires_grad_()
    grads = [torch.randn(tokens, width, device="cuda", generator=generator).bfloat16() for _ in range(2)]
    tensors = (x, y, weight, bias)
    moved = 4 * tokens * width * x.element_size()  # each way: two tensors read and two written, or three and one
    rows, results = [], {}
    block = torch.empty(2 * tokens, width, device="cuda", dtype=torch.bfloat16)
    copy_s = gpu_time(lambda: block.clone(), warmup, repeat)
    rows.append({"shape": shape, "tokens": tokens, "width": width, "impl": "copy", "ms": copy_s * 1e3,
                 "gb_per_s": moved / copy_s / 1e9})
    for name, fn in {"eager": eager, "inductor": torch.compile(eager), "fused": fused}.items():
        try:  # the recorded forward costs as the graph-free one
            forward_s, backward_s, results[name] = time_forward_backward(fn, tensors, grads, warmup, repeat)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot run a shape is a row too
            rows.append({"shape": shape, "impl": name, "error": str(error)[:500]})
            continue
        rows.append({"shape": shape, "tokens": tokens, "width": width, "impl": name,
                     "tiles": [*layernorm.TILES["forward"], *layernorm.TILES["backward"],
                               layernorm.BACKWARD_PROGRAMS_PER_SM] if name == "fused" else None,
                     "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
                     "forward_gb_per_s": moved / forward_s / 1e9, "backward_gb_per_s": moved / backward_s / 1e9})
    for row in rows:
        if row.get("impl") in results and "eager" in results and row["impl"] != "eager":
            for part, want, got in zip(("s", "out", "dx", "dy", "dweight", "dbias"), results["eager"],
                                       results[row["impl"]], strict=True):
                row[f"{part}_rel_diff_vs_eager"] = float((got - want).norm() / want.norm())
    return rows


def main() -> None:
    args = kernel_arguments(__doc__, SHAPES, 30, "layernorm.py")
    rows = tune(args.shapes.split(","), args.warmup, args.repeat) if args.tune else []
    for shape in args.shapes.split(","):
        measured = measure(shape, args.warmup, args.repeat)
        for row in measured:
            print(json.dumps(row), flush=True)
        rows += measured
        write_results(args.out, rows)
    print_speedups(rows, args.shapes.split(","))


if __name__ == "__main__":
    main()
