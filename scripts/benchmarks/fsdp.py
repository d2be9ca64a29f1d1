"""DDP against FSDP (``trainer.parallel``) side by side in one launch: step time, samples/s per GPU
and peak GPU memory of a GradCache step on synthetic inputs, per model and sub-batch; a setting that
runs out of memory is recorded as such and the next one runs.

    torchrun --nproc_per_node=2 scripts/benchmarks/fsdp.py --model vit_l14 --sub-batch 64,128 --out fsdp.json
    torchrun --nproc_per_node=2 scripts/benchmarks/fsdp.py --model openclip --set model.arch=ViT-bigG-14 \\
        --sub-batch 16,32,64 --out bigg.json

On one GPU (``python scripts/benchmarks/fsdp.py ...``) the model is "sharded" over a group of one rank:
nothing is saved, but the sharded code path (bf16 gathers, fp32 reduction, compile) runs and its
overhead shows. ``--sub-batches``: sub-batches per rank and step (the rank batch is their product).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from itertools import repeat

import torch
import torch.distributed as dist
from bench import trainer_step, write_results

from megabatch.config.compose import compose
from megabatch.data.synthetic import synthetic_sub_batch


def one_setting(parallel: str, overrides: list[str], sub_batch: int, sub_batches: int, steps: int,
                fsdp_reduce: str, device: torch.device) -> dict:
    world = dist.get_world_size()
    cfg = compose(*overrides, f"batch={sub_batch * sub_batches * world}", f"trainer.sub_batch={sub_batch}",
                  "trainer.precision=bf16", f"trainer.parallel={parallel}", f"trainer.fsdp_reduce={fsdp_reduce}")
    torch.cuda.reset_peak_memory_stats(device)
    step = trainer_step(cfg, device)  # the trainer's: sharded under trainer.parallel=fsdp, compiled with model.compile
    model = step.model
    sub = synthetic_sub_batch(sub_batch, model.image_size, model.context_length, device)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step.gradients(repeat(sub))
        step.apply()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    rank_batch = sub_batch * sub_batches
    return {"parallel": parallel, "fsdp_reduce": fsdp_reduce if parallel == "fsdp" else None, "ranks": world,
            "sub_batch": sub_batch, "rank_batch": rank_batch, "global_batch": rank_batch * world,
            "step_s": times, "median_step_s": steady, "samples_s_per_gpu": rank_batch / steady,
            "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides, e.g. model.arch=ViT-bigG-14")
    parser.add_argument("--sub-batch", default="64", help="comma-separated sub-batch sizes")
    parser.add_argument("--sub-batches", type=int, default=4)
    parser.add_argument("--parallel", default="ddp,fsdp")
    parser.add_argument("--fsdp-reduce", default="sub_batch", help="sub_batch, step, or both: sub_batch,step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rows = []
    try:
        for sub_batch in (int(s) for s in args.sub_batch.split(",")):
            for parallel in args.parallel.split(","):
                for reduce in args.fsdp_reduce.split(",") if parallel == "fsdp" else ["sub_batch"]:
                    try:
                        row = one_setting(parallel, [f"model={args.model}", *args.set], sub_batch, args.sub_batches,
                                          args.steps, reduce, device)
                    except torch.OutOfMemoryError as error:
                        row = {"parallel": parallel, "fsdp_reduce": reduce, "sub_batch": sub_batch,
                               "out_of_memory": str(error).splitlines()[0][:200]}
                    gc.collect()
                    torch.cuda.empty_cache()
                    if dist.get_rank() == 0:
                        print(json.dumps({k: v for k, v in row.items() if k != "step_s"}), flush=True)
                        rows.append(row)
                        write_results(args.out, rows, model=args.model, overrides=args.set,
                                      gpu=torch.cuda.get_device_name(device))
                    dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
