"""GradCache training throughput and memory on one GPU, side by side with OpenCLIP's --accum-freq.

    python scripts/benchmarks/gradcache.py --out gc.json                        # the default grid
    python scripts/benchmarks/gradcache.py --batches 16k,64k,256k --only memory --out mem.json

Synthetic inputs, the same for both sides: ``--data gpu`` keeps one random image/token sub-batch on
the GPU and reuses it (neither side pays for data); ``--data loader`` feeds both from OpenCLIP's own
synthetic dataset (a blank PIL image through its training transforms, tokenised caption) in a
DataLoader with ``--workers`` workers and pinned memory, as OpenCLIP's ``--dataset-type synthetic``
does (the data cost of the reference figures in ANCHORS.md); our side reads that loader ahead in a
thread as the trainer does (``trainer.prefetch_gb``; ``--prefetch-gb`` lists the budgets to compare,
0 without it; the trainer itself reads ahead only in steps with a replay), so its workers keep
decoding the next step's inputs while the loss and the replay run. The same model (open_clip
ViT-B/32), precision (bf16 autocast), global batch and sub-batch. Ours: one ``TrainStep`` (encode
without graph, loss once, replay; then ``apply``), built without a run (``bench.trainer_step``).
OpenCLIP 3.3: its own
``open_clip_train.train.train_one_epoch`` with ``--accum-freq`` (it re-forwards each sub-batch and
recomputes the whole loss once per sub-batch).
The first step of every configuration (``--warmup-steps``) is a warm-up and not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from itertools import repeat

import torch
from bench import openclip_training, peak_gb, reset_peak, sync, trainer_step, write_results

from megabatch.config import parse_count
from megabatch.config.compose import compose
from megabatch.data.samples import SubBatch
from megabatch.data.synthetic import synthetic_sub_batch


def loader_batches(sub_batch: int, workers: int, device, move: bool = True):
    """Endless ``(images, texts)`` sub-batches from OpenCLIP's SyntheticDataset, moved to ``device``
    (``move=False``: left in pinned host memory, for our trainer, which moves them itself)."""
    import open_clip
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset

    class Synthetic(Dataset):  # open_clip_train.data.SyntheticDataset's work (that module needs pandas)
        def __init__(self):
            self.image, self.transform = Image.new("RGB", (224, 224)), open_clip.image_transform(224, is_train=True)
            self.tokens = open_clip.get_tokenizer("ViT-B-32")(["Dummy caption"])[0]

        def __len__(self):
            return 1 << 30

        def __getitem__(self, index):
            return self.transform(self.image), self.tokens

    dataset = Synthetic()
    loader = DataLoader(dataset, batch_size=sub_batch, shuffle=False, num_workers=workers,
                        pin_memory=device.type == "cuda", drop_last=True, persistent_workers=True)
    for images, texts in loader:
        if move:
            yield images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
        else:
            yield SubBatch(images, texts, None)


def ours(model: str, loss: str, batch: int, sub_batch: int, steps: int, device,
         warmup: int = 1, data: str = "gpu", workers: int = 12, prefetch_gb: float = 0) -> dict:
    from megabatch.data.read_ahead import ReadAhead

    cfg = compose(f"model={model}", f"loss={loss}", f"batch={batch}", f"trainer.sub_batch={sub_batch}",
                  "optim.lr=5e-4")
    step = trainer_step(cfg, device)  # the trainer's own step
    stream = loader = None
    if data == "loader":  # one for all steps, read ahead as the trainer does (trainer.prefetch_gb)
        stream = loader = loader_batches(sub_batch, workers, device, move=False)
        if prefetch_gb > 0:
            stream = ReadAhead(loader, prefetch_gb * 1e9)
    else:  # one sub-batch kept on the GPU, reused: no data cost
        stream = repeat(synthetic_sub_batch(sub_batch, step.model.image_size, step.model.context_length, device))

    times = []
    phases = {}
    reset_peak(device)
    for index in range(steps + warmup):
        sync(device)
        start = time.perf_counter()
        _, phase_times = step.gradients(stream)
        step.apply()
        sync(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
            for key, value in phase_times.items():
                phases[key] = phases.get(key, 0) + value / steps
    result = {"system": "megabatch", "model": model, "loss": loss, "batch": batch,
              "sub_batch": sub_batch, "step_s": sum(times) / len(times),
              "samples_per_s": batch * len(times) / sum(times), "phases_s": phases,
              "peak_gpu_gb": peak_gb(device)}
    del step
    if isinstance(stream, ReadAhead):
        stream.close()
    if loader is not None:
        loader.close()  # stops its loader workers
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return result


def openclip(batch: int, sub_batch: int, steps: int, device, data: str = "gpu", workers: int = 12,
             warmup: int = 1) -> dict:
    """OpenCLIP 3.3's own training loop (``bench.openclip_training``) on the same inputs."""
    fixed = synthetic_sub_batch(sub_batch, 224, 77, device)
    stream = loader_batches(sub_batch, workers, device) if data == "loader" else repeat((fixed.images, fixed.texts))
    result = openclip_training(stream, batch, sub_batch, steps, device, warmup=warmup)
    if data == "loader":
        stream.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="throughput,memory")
    parser.add_argument("--batch", default="32k", help="throughput comparison's global batch")
    parser.add_argument("--sub-batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--loss", default="local", help="our loss backend for the comparison")
    parser.add_argument("--batches", default="16k,64k,256k", help="memory sweep (fixed sub-batch)")
    parser.add_argument("--memory-loss", default="infcl")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--data", default="gpu", choices=["gpu", "loader"],
                        help="throughput inputs: one sub-batch kept on the GPU, or OpenCLIP's synthetic loader")
    parser.add_argument("--workers", type=int, default=12, help="loader workers for --data loader")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first, at --batch")
    parser.add_argument("--warmup-steps-small", type=int, default=1,
                        help="untimed steps first at batch = --sub-batch (a host cache that fills over "
                             "seconds, such as pinned memory for the read-ahead, needs more than one)")
    parser.add_argument("--prefetch-gb", default="8",
                        help="--data loader: our trainer.prefetch_gb values to compare (comma-separated)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("MEGABATCH_CACHE", "/tmp/megabatch-cache")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    batch, sub = parse_count(args.batch, "--batch"), args.sub_batch
    results = []

    def record(row):
        print(json.dumps(row), flush=True)
        results.append(row)
        write_results(args.out, results)

    if "throughput" in args.only:
        data = dict(data=args.data, workers=args.workers)
        prefetch = [float(v) for v in args.prefetch_gb.split(",")] if args.data == "loader" else [0.0]
        for gb in prefetch:  # no sub-batching
            record({**ours("vit_b32", args.loss, sub, sub, 4 * args.steps, device, **data, prefetch_gb=gb,
                           warmup=args.warmup_steps_small), **data, "prefetch_gb": gb})
        record({**openclip(sub, sub, 4 * args.steps, device, **data, warmup=args.warmup_steps_small),
                **data})  # no accumulation
        for gb in prefetch:
            record({**ours("vit_b32", args.loss, batch, sub, args.steps, device, **data, prefetch_gb=gb,
                           warmup=args.warmup_steps), **data, "prefetch_gb": gb})
        record({**openclip(batch, sub, args.steps, device, **data, warmup=args.warmup_steps), **data})
    if "memory" in args.only:
        for size in args.batches.split(","):
            # one step, no warm-up: the peak memory is the point, and a 1M step takes minutes
            record(ours("vit_b32", args.memory_loss, parse_count(size, "--batches"), sub, 1, device,
                        warmup=0))


if __name__ == "__main__":
    main()
