"""Writing embeddings into shards (``scripts/make_shards.py image-features`` and ``teacher``): images a second
on JPEG shards, side by side in one run with the way they were written before (the decoding in the main process,
an eager forward: ``--workers 0 --no-compile``) and with the model's own forward alone on images already on the
GPU (the ceiling: what the GPU does without any data), each with its TFLOP/s and share of the GPU's bf16 peak, and
on a GPU each image tower's features against the model's own in float32 (the smallest cosine over a batch).

    python scripts/benchmarks/embed_shards.py --arch ViT-L-14 --shards 96 --out embed_shards_vit_l14_h200.json

Writes ``--shards`` shards of ``--per-shard`` distinct photo-like JPEGs (``--size`` px, in processes, once);
each measured write goes to a new folder (nothing skipped), after a warm-up write of one shard that compiles the
forward (``--compile``: its seconds reported apart). Random weights: the timing is the weights'."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_shard(folder: str, index: int, per_shard: int, size: int) -> tuple[str, int]:
    """Shard ``index`` of distinct photos (seeded by its index), as ``photo-<index>.tar``."""
    from megabatch.data.shard_writer import write_shards
    from megabatch.data.synthetic import photos

    scratch = Path(folder) / f".part-{index}"
    paths = write_shards(photos(per_shard, size, seed=index), scratch, "photo", per_shard)
    target = Path(folder) / f"photo-{index:06d}.tar"
    os.replace(paths[0], target)
    shutil.rmtree(scratch, ignore_errors=True)
    return target.name, per_shard


def shards(folder: Path, count: int, per_shard: int, size: int) -> list[str]:
    """``count`` shards in ``folder`` with ``sizes.json``, written in processes (kept for the next run)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"photo-{index:06d}.tar" for index in range(count)]
    missing = [index for index, name in enumerate(names) if not (folder / name).exists()]
    if missing:
        with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
            list(pool.map(make_shard, [str(folder)] * len(missing), missing, [per_shard] * len(missing),
                          [size] * len(missing)))
    (folder / "sizes.json").write_text(json.dumps({name: per_shard for name in names}))
    return [str(folder / name) for name in names]


def ceiling(encode, size: tuple[int, int], batch: int, device: torch.device, context: int, repeat: int) -> float:
    """Images a second of ``encode`` alone on one batch already on the device (after one call)."""
    images = torch.randint(0, 255, (batch, 3, *size), dtype=torch.uint8, device=device)
    tokens = [torch.ones((batch, context), dtype=torch.long)] if context else []
    encode(images, tokens)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        encode(images, tokens)
    torch.cuda.synchronize(device)
    return batch * repeat / (time.perf_counter() - start)


def loader_alone(urls: list[str], size: tuple[int, int], batch: int, workers: int, per_shard: int) -> dict:
    """Images a second the writer's loader workers decode and cut, with nothing else running (no GPU, no copies):
    the rate decoding on the host allows."""
    from torch.utils.data import DataLoader

    from megabatch.data.embedding_writer import ShardRows

    loader = DataLoader(ShardRows([Path(url) for url in urls], size, batch, None), batch_size=None,
                        num_workers=workers, prefetch_factor=4)
    start, rows = time.perf_counter(), 0
    for item in loader:
        rows += len(item.keys)
    seconds = time.perf_counter() - start
    return {"kind": "loader", "workers": workers, "batch": batch, "shards": len(urls), "samples": rows,
            "seconds": round(seconds, 2), "images_per_s": round(rows / seconds, 1)}


def exact_features(arch: str, urls: list[str], size: tuple[int, int], batch: int, device: torch.device):
    """``(images, features)``: the first shard's first ``batch`` images (uint8, on ``device``) and the features of the
    model as it is built (open_clip's blocks, the exact GELU) in float32 without TF32, eager: what the writers' bf16
    forwards are held against (``min_cosine_to_float32``)."""
    from torch.utils.data import DataLoader

    from megabatch.data.embedding_writer import ShardRows
    from megabatch.models.images import normalize_images
    rows = next(iter(DataLoader(ShardRows([Path(urls[0])], size, batch, None), batch_size=None, num_workers=0)))
    images = rows.images.to(device)
    model = seeded(arch).to(device).eval()
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            features = model.encode_image(normalize_images(images, model.preprocess["mean"], model.preprocess["std"]))
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    del model
    return images, features.float()


def main() -> None:
    from bench import write_results

    from megabatch.data.embedding_writer import write_embedded_shards
    from megabatch.train.step.teacher import (
        Teacher,
        for_inference,
        image_encoder,
        teacher_encoder,
    )
    from megabatch.train.step.utilization import count_model_flops, gpu_peak

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="ViT-L-14", help="an open_clip architecture (random weights)")
    parser.add_argument("--shards", type=int, default=96)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--size", type=int, default=256, help="the JPEGs' side in px")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=None, help="loader workers (default: the cores less one)")
    parser.add_argument("--kinds", default="loader,image-features,exact-gelu,teacher,reference",
                        help="what to measure, in turn: loader (the loader workers alone: decoding's ceiling), "
                        "image-features (the tanh GELU in the GEMM's epilogue), exact-gelu (image-features with the "
                        "exact GELU), teacher, "
                        "open-clip-blocks (image-features without for_inference), max-autotune (image-features, "
                        "inductor's GEMM autotuning), reference")
    parser.add_argument("--reference-shards", type=int, default=4, help="shards the reference writes")
    parser.add_argument("--workdir", default="/tmp/embed-bench")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workers = args.workers if args.workers is not None else max(1, min(16, (os.cpu_count() or 2) - 1))
    workdir = Path(args.workdir)
    made = time.perf_counter()
    urls = shards(workdir / "source", args.shards, args.per_shard, args.size)
    made = time.perf_counter() - made
    model = seeded(args.arch)
    texts = torch.ones((2, model.context_length), dtype=torch.long)
    images = torch.zeros((2, 3, *(model.image_size,) * 2), dtype=torch.uint8)
    flops = count_model_flops(model.train(), images, texts)  # training mode: nn.MultiheadAttention's counted path
    peak = gpu_peak(device)
    results = []

    def measure(kind: str, encode, size, compiled: bool, count: int, tokenizers=(), caption_key=None,
                per_image_flops: float = 0.0, measured_workers: int = workers) -> None:
        out = workdir / f"out-{kind}"
        calls: list[float] = []

        def timed(images, tokens):  # each batch's launch: the loop waits for the one before, so launches pace it
            calls.append(time.perf_counter())
            return encode(images, tokens)

        shutil.rmtree(out, ignore_errors=True)
        warm = time.perf_counter()
        write_embedded_shards(urls[:1], out / "warm-up", "x.npy", encode, size=size, device=device, batch=args.batch,
                              workers=min(measured_workers, 1), caption_key=caption_key, tokenizers=tokenizers,
                              show_progress=False)
        warm = time.perf_counter() - warm
        start = time.perf_counter()
        calls.clear()
        written = write_embedded_shards(urls[:count], out / "measured", "x.npy", timed, size=size, device=device,
                                        batch=args.batch, workers=measured_workers, caption_key=caption_key,
                                        tokenizers=tokenizers, show_progress=False)
        seconds = time.perf_counter() - start
        rate = count * args.per_shard / seconds
        # steady: the batches between the first launch and the last (the processes' start-up, the first batch's
        # decoding and the last copies' writing left out): the rate a run of many shards approaches
        steady = (len(calls) - 1) * args.batch / (calls[-1] - calls[0]) if len(calls) > 2 else None
        row = {"kind": kind, "compiled": compiled, "workers": measured_workers, "batch": args.batch, "shards": count,
               "samples": count * args.per_shard, "written": len(written), "seconds": round(seconds, 2),
               "images_per_s": round(rate, 1), "steady_images_per_s": round(steady, 1) if steady else None,
               "warm_up_s": round(warm, 1),
               "tflops": round(rate * per_image_flops / 1e12, 1),
               "peak_share": round(rate * per_image_flops / 1e12 / peak.tflops, 3) if peak else None}
        if device.type == "cuda":
            alone = ceiling(encode, size, args.batch, device, model.context_length if tokenizers else 0, 20)
            row["forward_alone_images_per_s"] = round(alone, 1)
            row["forward_alone_peak_share"] = round(alone * per_image_flops / 1e12 / peak.tflops, 3) if peak else None
            if not tokenizers:  # an image tower: its features against the model's own in float32
                with torch.no_grad():
                    have = encode(reference[0], []).float()
                row["min_cosine_to_float32"] = round(float(torch.nn.functional.cosine_similarity(
                    have, reference[1]).min()), 6)
        print(json.dumps(row), flush=True)
        results.append(row)
        write_results(args.out, results, arch=args.arch, size=args.size, per_shard=args.per_shard,
                      source_shards_written_s=round(made, 1), image_forward_gflop=flops.image_forward / 1e9,
                      text_forward_gflop=flops.text_forward / 1e9, gpu_peak_tflops=peak.tflops if peak else None)

    reference = exact_features(args.arch, urls, (model.image_size,) * 2, args.batch, device) \
        if device.type == "cuda" else None
    image_only = flops.image_forward
    both = flops.image_forward + flops.text_forward
    for kind in args.kinds.split(","):
        if kind == "loader":
            results.append(loader_alone(urls, (model.image_size,) * 2, args.batch, workers, args.per_shard))
            print(json.dumps(results[-1]), flush=True)
            write_results(args.out, results, arch=args.arch, size=args.size, per_shard=args.per_shard,
                          source_shards_written_s=round(made, 1), image_forward_gflop=flops.image_forward / 1e9,
                          text_forward_gflop=flops.text_forward / 1e9, gpu_peak_tflops=peak.tflops if peak else None)
        elif kind == "image-features":
            tower = Teacher(for_inference(seeded(args.arch), "tanh"), 1.0, device, compile=True)
            measure(kind, *image_encoder(tower), True, args.shards, per_image_flops=image_only)
        elif kind == "exact-gelu":  # image-features with the blocks' exact GELU (for_inference's gelu="erf")
            tower = Teacher(for_inference(seeded(args.arch), "erf"), 1.0, device, compile=True)
            measure(kind, *image_encoder(tower), True, args.shards, per_image_flops=image_only)
        elif kind == "teacher":
            teacher = Teacher(for_inference(seeded(args.arch), "tanh"), 100.0, device, compile=True)
            measure(kind, *teacher_encoder([teacher]), True, args.shards, [teacher.model.tokenizer()], "txt",
                    per_image_flops=both)
        elif kind == "open-clip-blocks":  # image-features with open_clip's own attention blocks and patch convolution
            tower = Teacher(seeded(args.arch), 1.0, device, compile=True)
            measure(kind, *image_encoder(tower), True, args.shards, per_image_flops=image_only)
        elif kind == "max-autotune":  # image-features compiled with inductor's GEMM autotuning (a longer compile)
            tower = Teacher(for_inference(seeded(args.arch)), 1.0, device, compile=False)
            tower.encode_image = torch.compile(tower.model.encode_image, mode="max-autotune-no-cudagraphs")
            measure(kind, *image_encoder(tower), True, args.shards, per_image_flops=image_only)
        elif kind == "reference":  # as they were written before: decoded in the main process, eager
            teacher = Teacher(seeded(args.arch), 100.0, device, compile=False)
            measure(kind, *teacher_encoder([teacher]), False, args.reference_shards, [teacher.model.tokenizer()],
                    "txt", per_image_flops=both, measured_workers=0)
        else:
            parser.error(f"--kinds: {kind}? loader, image-features, exact-gelu, teacher, open-clip-blocks, "
                         "max-autotune or reference")


def seeded(arch: str):
    """``arch`` with random weights, the same ones at every call (the features of two builds compare)."""
    from megabatch.train.step.teacher import load_teacher_model

    torch.manual_seed(0)
    return load_teacher_model(_cfg(arch))


def _cfg(arch: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({"teacher": arch, "pretrained": None})


if __name__ == "__main__":
    main()
