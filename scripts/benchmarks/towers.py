"""Where a GradCache sub-batch spends its GPU time: each tower timed alone (graph-free forward, and
forward + backward as the replay runs it) under bf16 autocast, as TFLOP/s of its model FLOPs, per
variant (eager, compiled, compile modes, SDPA kernels, bf16-held weights); one compiled replay
profiled by kernel class (GEMM, attention, fused elementwise, ...) with the GPU's busy fraction;
and cuBLAS alone on the towers' GEMM shapes, the ceiling the towers can approach.

    python scripts/benchmarks/towers.py --model vit_b16 --sub-batch 512 --out towers.json
    python scripts/benchmarks/towers.py --model vit_b16 --variants compile,compile-max-autotune --out t.json

Variants: ``eager``, ``compile`` (``model.compile=true`` as the trainer compiles), ``compile-max-autotune``
(inductor's ``max-autotune-no-cudagraphs``: Triton GEMM templates tried against cuBLAS),
``compile-sdpa-<flash|cudnn|efficient|math>`` (one attention kernel forced), ``compile-bf16-weights``
(weights held in bf16: what casting them once per step instead of once per call could save at most),
a ``direct`` anywhere in the name: ``model.direct_attention=true`` (``compile-direct``,
``compile-direct-max-autotune``), a ``patch`` anywhere: ``model.patch_gemm=true``
(``compile-direct-patch``), a ``triton`` anywhere: ``model.attention=triton`` (the project's attention
kernels, with ``direct``: ``compile-direct-triton``), an ``auto``: ``model.attention=auto``, a ``tanh``:
``model.gelu=tanh`` (cuBLASLt's tanh-GELU epilogue in the graph-free forward); without them they are off
(SDPA, exact GELU). (The ``fused`` and ``addln`` variants of the recorded JSONs measured ``model.fused_mlp``
and ``model.fused_layernorm``, since removed: docs/performance.md.)

A NaFlex model (``--model vit_b16_naflex``) is fed images of ``--aspects`` (width / height), each of 256^2 px
area, resized and patchified at its ``max_seq_len`` as the loader does (padding and all): without ``direct`` its
attention is timm's (a ``[n, 1, L, L]`` mask, SDPA), with it ``LengthsAttention`` (each image's length, the
Triton kernels with ``auto``/``triton``, SDPA with a key mask with ``sdpa``). The tokens a second count every
row of the padded input; ``padding_share`` says how much of it is padding.

    python scripts/benchmarks/towers.py --model vit_b16_naflex --aspects 1 1.5 0.6667 2 0.5 \
        --variants compile,compile-direct-auto --sub-batch 1024 --out naflex_towers.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from bench import kernel_summary, write_results

from megabatch.config.compose import compose
from megabatch.kernels.packed_patches import unpack
from megabatch.train.step.utilization import count_model_flops, gpu_peak

SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sdpa_context(variant: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in SDPA.items():
        if variant.endswith(f"sdpa-{name}"):
            return sdpa_kernel([getattr(SDPBackend, backend)])
    return contextlib.nullcontext()


def build(model_name: str, overrides: list[str], variant: str, rows: int, device: torch.device):
    from megabatch.models import build_model
    from megabatch.runtime.process import configure_backends

    torch.manual_seed(0)
    direct = f"model.direct_attention={str('direct' in variant).lower()}"
    patch = f"model.patch_gemm={str('patch' in variant).lower()}"
    compiled = f"model.compile={str(variant.startswith('compile')).lower()}"
    attention = "model.attention=" + next((k for k in ("triton", "auto") if k in variant), "sdpa")
    gelu = "model.gelu=" + ("tanh" if "tanh" in variant else "erf")
    cfg = compose(f"model={model_name}", *overrides, direct, patch, compiled, attention, gelu)
    configure_backends(cfg, device)  # as the Trainer does, before building
    model = build_model(cfg.model).to(device).train()
    model.trim_text(True)
    if variant.endswith("bf16-weights"):
        model.to(torch.bfloat16)
    if variant.startswith("compile"):
        model.compile_towers(rows)
        if "max-autotune" in variant:
            import torch._inductor.config as inductor_config

            inductor_config.max_autotune = True
            inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    return model


def naflex_images(model, rows: int, aspects: list[float], device: torch.device) -> torch.Tensor:
    """``rows`` packed images of a NaFlex tower at its ``max_seq_len``, of the ``aspects`` in turn (256^2 px each,
    random pixels), as ``data/naflex.py`` packs a sub-batch."""
    from megabatch.data.naflex import NaFlexSpec

    cfg = model.naflex
    spec = NaFlexSpec(patch_size=cfg.patch_size, max_seq_len=cfg.max_seq_len, seq_lens=(cfg.max_seq_len,))
    generator = torch.Generator().manual_seed(0)
    shapes = [(round(256 / aspect ** 0.5), round(256 * aspect ** 0.5)) for aspect in aspects]
    each = [spec.patches(torch.randint(0, 256, (3, *shape), dtype=torch.uint8, generator=generator),
                         cfg.max_seq_len) for shape in shapes]
    return spec.collate([each[i % len(each)] for i in range(rows)]).to(device)


def tower_times(model, images: torch.Tensor, texts: torch.Tensor, repeats: int, variant: str) -> dict:
    """Seconds of the graph-free forward and of forward + backward of each tower (a forced SDPA
    kernel applies to the image tower: the text tower's mask rules flash out)."""
    out = {}
    for tower, inputs in (("image", images), ("text", texts)):
        kernel = variant if tower == "image" else "default"  # sdpa_context() is single use: one per call

        def forward(tower=tower, inputs=inputs, kernel=kernel):
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16), sdpa_context(kernel):
                model._encode(tower, inputs)

        def replay(tower=tower, inputs=inputs, kernel=kernel):
            with torch.autocast("cuda", torch.bfloat16), sdpa_context(kernel):
                features = model._encode(tower, inputs)
            features.backward(torch.ones_like(features))

        out[f"{tower}_forward_s"] = timed(forward, repeats)
        out[f"{tower}_replay_s"] = timed(replay, repeats)
    model.zero_grad(set_to_none=True)
    return out


def profile_replay(model, images: torch.Tensor, texts: torch.Tensor) -> dict:
    """One replay of both towers under the profiler: GPU time per kernel class, the top kernels, and
    the busy fraction (kernel time over the wall time of the profiled region)."""
    from torch.profiler import ProfilerActivity, profile

    def replay():
        with torch.autocast("cuda", torch.bfloat16):
            image, text = model._encode("image", images), model._encode("text", texts)
        (image.sum() + text.sum()).backward()

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        replay()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return kernel_summary(prof, wall, top=40)


def gemm_ceiling(model, rows: int, text_length: int, device: torch.device) -> list[dict]:
    """cuBLAS bf16 TFLOP/s on each distinct Linear shape of the towers at ``rows`` sequences."""
    tokens = {"image": rows * model.clip.visual.positional_embedding.shape[0], "text": rows * text_length}
    shapes = set()
    for tower in ("image", "text"):
        for name, module in model.clip.named_modules():
            if name.startswith("visual.") != (tower == "image"):
                continue
            if isinstance(module, torch.nn.Linear):
                shapes.add((tower, tokens[tower], module.in_features, module.out_features))
            elif isinstance(module, torch.nn.MultiheadAttention):
                shapes.add((tower, tokens[tower], module.embed_dim, 3 * module.embed_dim))
    results = []
    for tower, m, k, n in sorted(shapes):
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        seconds = timed(lambda a=a, b=b: a @ b, 10)
        results.append({"tower": tower, "m": m, "k": k, "n": n, "tflops": 2 * m * k * n / seconds / 1e12})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--set", nargs="*", default=[], help="more model overrides, e.g. model.arch=ViT-L-14")
    parser.add_argument("--sub-batch", type=int, default=512)
    parser.add_argument("--text-length", type=int, default=32, help="caption tokens (trimmed text)")
    parser.add_argument("--variants",
                        default="eager,compile,compile-sdpa-cudnn,compile-sdpa-flash,compile-bf16-weights")
    parser.add_argument("--profile", default="compile", help="variants whose replay is profiled by kernel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--aspects", type=float, nargs="+", default=[1.0],
                        help="a NaFlex model's images: width / height of each in turn")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/towers.py times the towers' GPU kernels and needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = gpu_peak(device)
    rows = []
    for variant in args.variants.split(","):
        model = build(args.model, args.set, variant, args.sub_batch, device)
        images, texts = model.example_inputs(args.sub_batch, device)
        if model.naflex is not None:
            images = naflex_images(model, args.sub_batch, args.aspects, device)
        texts = texts[:, :args.text_length].clone()
        texts[:, -1] = 49407  # end of text last: the pooled token
        with torch.autocast("cuda", torch.bfloat16):
            flops = count_model_flops(model, images, texts)
        row = {"variant": variant}
        if model.naflex is not None:  # the padding's share of the image tower's tokens (its rows of zeros)
            cfg = model.naflex
            valid = float(unpack(images, cfg.patch_size, (0.0,) * 3, (1.0,) * 3)["patch_valid"].float().mean())
            row.update(padding_share=1 - valid, image_tokens=images.shape[1])
        try:
            row.update(tower_times(model, images, texts, args.repeats, variant))
        except Exception as error:  # a kernel this GPU or mask cannot run: recorded, and the next variant runs
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        for tower, forward_flops in (("image", flops.image_forward), ("text", flops.text_forward)):
            if f"{tower}_replay_s" in row:
                work = forward_flops * args.sub_batch
                row[f"{tower}_forward_tflops"] = work / row[f"{tower}_forward_s"] / 1e12
                row[f"{tower}_replay_tflops"] = 3 * work / row[f"{tower}_replay_s"] / 1e12
        if variant in args.profile.split(","):
            row["profile"] = profile_replay(model, images, texts)
        row["peak_tflops"] = peak.tflops
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "profile"}, flush=True)
        if "profile" in row:
            print(row["profile"]["classes_s"], "busy", round(row["profile"]["busy_fraction"], 3), flush=True)
            for kernel in row["profile"]["top_kernels"]:
                print(f"  {kernel['s'] * 1e3:8.2f} ms  {kernel['name']}", flush=True)
        rows.append(row)
        write_results(args.out, rows, model=args.model, sub_batch=args.sub_batch, text_length=args.text_length,
                      gpu=torch.cuda.get_device_name(device))
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    model = build(args.model, args.set, "eager", args.sub_batch, device)
    ceiling = [] if model.naflex is not None else gemm_ceiling(model, args.sub_batch, args.text_length, device)
    for shape in ceiling:
        print(shape, flush=True)
    write_results(args.out, rows, gemm_ceiling=ceiling, model=args.model, sub_batch=args.sub_batch,
                  text_length=args.text_length, gpu=torch.cuda.get_device_name(device))


if __name__ == "__main__":
    main()
