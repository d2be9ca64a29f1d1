"""Can the one-pass step (one sub-batch: one forward, the loss, one backward) be GradCache with one sub-batch whose
phase-1 graph is kept (encode with a graph, the loss on detached features, the surrogate's backward)? Issue 80
asks: if the second costs under 2%, the separate one-pass path could go.

    python scripts/benchmarks/one_pass.py --arch ViT-B-16 --batch 256 --set model.compile=true --out one_pass.json

Both on the trainer's own step (``bench.trainer_step``), the same synthetic sub-batch kept on the GPU (no
data cost), then ``apply``; the two alternate, ``--rounds`` times after ``--warmup`` each, and each step is timed
alone (the GPU waited for before and after). Reports each side's median seconds a step and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from itertools import repeat

import torch
from bench import peak_gb, reset_peak, sync, trainer_step, write_results

from megabatch.config.compose import compose
from megabatch.data.synthetic import synthetic_sub_batch
from megabatch.runtime.process import configure_process


def main() -> None:
    configure_process()  # what train.py sets first, before CUDA starts
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="openclip")
    parser.add_argument("--arch", default="ViT-B-16")
    parser.add_argument("--loss", default="infcl")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--set", nargs="*", default=["model.compile=true"], help="more config overrides")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = compose(f"model={args.model}", *([f"model.arch={args.arch}"] if args.model == "openclip" else []),
                  f"loss={args.loss}", f"batch={args.batch}", f"trainer.sub_batch={args.batch}", "optim.lr=5e-4",
                  *args.set)
    step = trainer_step(cfg, device)  # one sub-batch a step: TrainStep.gradients takes the one-pass path
    sub = synthetic_sub_batch(args.batch, step.model.image_size, step.model.context_length, device)
    direct_keep, cached_keep = step.keep, replace(step.keep, kept_graphs=1)  # GradCache's one sub-batch, kept

    def one_pass():
        step.keep, step.one_pass = direct_keep, True
        step.gradients(repeat(sub))
        step.apply()

    def gradcache_kept():
        step.keep, step.one_pass = cached_keep, False  # the path gradients() takes for several sub-batches
        step.gradients(repeat(sub))
        step.apply()

    sides = {"one_pass": one_pass, "gradcache_one_kept": gradcache_kept}
    seconds = {name: [] for name in sides}
    peaks = {}
    for name, fn in sides.items():
        reset_peak(device)
        for _ in range(args.warmup):  # compilation of both gradient modes, kernel tuning
            fn()
        sync(device)
        peaks[name] = peak_gb(device)
    for _ in range(args.rounds):
        for name, fn in sides.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    result = {"model": args.model, "arch": args.arch, "loss": args.loss, "batch": args.batch, "overrides": args.set,
              "median_step_s": medians, "step_s": seconds, "peak_gpu_gb": peaks,
              "gradcache_over_one_pass": medians["gradcache_one_kept"] / medians["one_pass"]}
    write_results(args.out, [result])
    print(f"one pass {medians['one_pass'] * 1e3:.1f} ms, GradCache with its one sub-batch kept "
          f"{medians['gradcache_one_kept'] * 1e3:.1f} ms a step: {result['gradcache_over_one_pass']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
