"""Why phase 1 can be slower than the loader: the training loader's samples/s while the consumer
copies each sub-batch to the GPU and queues GPU work, with pageable or pinned host memory.

    python scripts/benchmarks/loader_copy.py --workers 16 --out loader_copy.json

Variants: ``none`` (consume only, as benchmarks/loader.py), ``copy`` (pageable ``.to(cuda)``),
``copy+gpu`` (then ``--gpu-ms`` of GPU work per sub-batch, like phase 1's encoder: a pageable copy
waits for the queued kernels, so the loader cannot run ahead), ``pinned-copy+gpu``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import write_results

from megabatch.config.compose import compose
from megabatch.data.synthetic import photo_shards
from megabatch.models import build_model


def gpu_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    torch.cuda.synchronize()
    return 100_000_000 / start.elapsed_time(end)


def main() -> None:

    from megabatch.data import TrainData

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--sub-batch", type=int, default=512)
    parser.add_argument("--sub-batches", type=int, default=128, help="per variant; the first 16 are not timed")
    parser.add_argument("--gpu-ms", type=float, default=44.0, help="GPU work per sub-batch (ViT-B/32 encode, 512)")
    parser.add_argument("--workdir", default="/tmp/loader-copy")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    shards = photo_shards(4096, 256, Path(args.workdir) / "shards")
    cycles = gpu_cycles_per_ms() * args.gpu_ms
    results = []
    for variant in ["none", "copy", "copy+gpu", "pinned-copy+gpu"]:
        cfg = compose("model=vit_b32", "data=webdataset", f"data.num_workers={args.workers}")
        cfg.data.train.urls = shards * (args.sub_batches * args.sub_batch // 4096 + args.workers)
        model = build_model(cfg.model)  # its tokenizer and preprocessing
        data = TrainData(cfg.data, model.tokenizer(), model.preprocess, seed=0)
        loader = data.loader(epoch=0, start_batch=0, rank_batch=args.sub_batch * args.sub_batches, rank=0,
                             world_size=1, num_batches=1, sub_batch=args.sub_batch, keep_raw=True)
        kept, start = [], None
        for index, sub in enumerate(loader):
            if index == 16:
                torch.cuda.synchronize()
                start = time.perf_counter()
            images = sub.images.pin_memory() if variant.startswith("pinned") else sub.images
            if "copy" in variant:
                images.to("cuda", non_blocking=True)
            if "gpu" in variant:
                torch.cuda._sleep(int(cycles))
            kept.append(sub.raw)
        torch.cuda.synchronize()
        row = {"variant": variant, "samples_s": (len(kept) - 16) * args.sub_batch / (time.perf_counter() - start)}
        print(json.dumps(row), flush=True)
        results.append(row)
        write_results(args.out, results)


if __name__ == "__main__":
    main()
