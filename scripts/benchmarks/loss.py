"""Loss-only benchmark: forward + backward time and peak memory per GPU of each loss backend.

    python scripts/benchmarks/loss.py --batches 32k,64k,128k,256k,1M --dtypes fp32,bf16 --out loss.json
    torchrun --nproc_per_node=2 scripts/benchmarks/loss.py --batches 256k,1M --out loss2.json

Backends: ours (vanilla, local, disco, infcl = Triton kernels on CUDA, infcl_torch = plain-torch
tiles; infcl_distill = infcl plus the distillation term (the fused kernels on CUDA), against random
ViT-L/14-wide teacher features, infcl_distill_blocks = the same with the term in torch's row blocks of logits;
the sigmoid loss: siglip = Triton kernels, siglip_torch = plain-torch tiles) and, when
importable, the reference systems side by side in the same process: ``ref_openclip`` (OpenCLIP 3.3
``ClipLoss(local_loss=True, gather_with_grad=True)``), ``ref_infcl`` (``inf_cl.cal_inf_loss`` both
directions), ``ref_openclip_distill`` (OpenCLIP 3.3 ``DistillClipLoss``, its two terms summed) and
``ref_siglip`` (OpenCLIP 3.3 ``SigLipLoss``: each rank's rows against every text
block, exchanged between neighbours). Features are random, L2-normalised, ``[b / W, c]`` per rank;
the scale is a learnable 0-dim tensor at 100; sigmoid losses add a learnable bias at -10.

    python scripts/benchmarks/loss.py --backends siglip,ref_siglip,infcl --batches 32k,64k,128k,256k,1M --out sig.json
"extra_gb" is the peak allocated memory minus the inputs and their gradients (``.grad`` starts
empty; the gradients the loss returns become ``.grad`` and are subtracted once). A backend that runs
out of memory at some b is not tried at larger b. fp32 matmuls may use TF32 (``--tf32``, on by
default, as in ANCHORS.md). ``--dtypes fp32_bf16_values``: fp32 features holding bf16 values, the loss
called as GradCache's phase 2 calls it on its bf16 feature buffers (``values_in=torch.bfloat16``:
the Triton kernels' dot products in bf16, exact; gradients and GEMMs fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench import write_results

from megabatch.config import parse_count
from megabatch.losses import DiscoLoss, InfClLoss, LocalLoss, SigLipLoss, VanillaLoss
from megabatch.losses.base import ContrastiveLoss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32_bf16_values": torch.float32}
VALUES = {"fp32_bf16_values": torch.bfloat16}  # fp32 storage, values of this dtype (GradCache's phase 2)


def make_backend(name: str, tile: int, world: int, rank: int, fp32_precision: str = "tf32"):
    if name == "vanilla":
        return VanillaLoss()
    if name == "local":
        return LocalLoss()
    if name == "disco":
        return DiscoLoss()
    if name == "infcl":  # impl=auto: the Triton kernels on CUDA
        return InfClLoss(tile=tile, fp32_precision=fp32_precision)
    if name == "infcl_torch":  # the plain-torch tile reference of the same math
        return InfClLoss(tile=tile, impl="torch", fp32_precision=fp32_precision)
    if name in ("siglip", "siglip_torch"):
        loss = SigLipLoss(tile=tile, impl="auto" if name == "siglip" else "torch", fp32_precision=fp32_precision)
        return with_bias(loss)
    if name == "ref_siglip":
        from open_clip.loss import SigLipLoss as OpenClipSigLipLoss

        return with_bias(OpenClipSigLipLoss(rank=rank, world_size=world))
    if name == "ref_openclip":
        from open_clip.loss import ClipLoss

        loss = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
        return lambda i, t, s: loss(i, t, s)
    if name == "infcl_distill":  # infcl plus the distillation term (distill.teacher), against a random teacher
        from megabatch.losses.distill import DistilledLoss

        return with_teacher(DistilledLoss(InfClLoss(tile=tile, fp32_precision=fp32_precision), 1.0, 100.0))
    if name == "infcl_distill_blocks":  # the same, the distillation term in torch's row blocks of logits
        from megabatch.losses.distill import DistilledLoss

        return with_teacher(DistilledLoss(InfClLoss(tile=tile, fp32_precision=fp32_precision), 1.0, 100.0,
                                          impl="torch"))
    if name == "ref_openclip_distill":  # OpenCLIP 3.3 DistillClipLoss (--distill-model): both b x b logits
        from open_clip.loss import DistillClipLoss

        return with_teacher(DistillClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world))
    if name == "ref_infcl":
        from inf_cl import cal_inf_loss

        return lambda i, t, s: (cal_inf_loss(i, t, scale=s) + cal_inf_loss(t, i, scale=s)) / 2
    raise ValueError(f"unknown backend {name}")


TEACHER_WIDTH = 768  # ViT-L/14's embedding


def with_teacher(loss):
    """A distillation loss called as the others are, against random teacher features of the same rows
    (``TEACHER_WIDTH``), made by ``prepare`` before the timing (not counted as the loss's memory):
    megabatch's ``DistilledLoss`` (told ``values_in``) or OpenCLIP's ``DistillClipLoss`` (its two terms summed,
    as its trainer sums them; the teacher's scale 100)."""
    held = []

    def prepare(images: torch.Tensor) -> None:
        held.clear()
        generator = torch.Generator(device=images.device).manual_seed(1)
        held.extend(F.normalize(torch.randn(images.shape[0], TEACHER_WIDTH, device=images.device,
                                            generator=generator), dim=-1).to(images.dtype) for _ in range(2))

    def call(i, t, s, **told):
        if hasattr(loss, "teacher_scale"):  # megabatch's
            return loss(i, t, s, teacher=tuple(held), **told)
        out = loss(i, t, s, *held, torch.tensor(100.0, device=i.device), output_dict=True)
        return out["contrastive_loss"] + out["distill_loss"]

    call.prepare, call.takes_values_in = prepare, hasattr(loss, "teacher_scale")
    return call


def with_bias(loss):
    """A sigmoid loss called as the others are, with its own learnable bias (-10, SigLIP's init)."""
    bias = torch.tensor(-10.0, device="cuda", requires_grad=True)
    return lambda i, t, s: loss(i, t, s, bias)


def sync() -> None:
    """The GPU and (on a ring) every rank: around every timed region."""
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def measure(loss_fn, b_local: int, dim: int, dtype, repeats: int, device, preallocate: bool = False,
            values: torch.dtype | None = None) -> dict:
    """Median time of forward + backward and the extra memory: peak allocated minus the inputs
    and their gradients (the gradients the loss returns become ``.grad``; counted once). With
    ``preallocate`` the ``.grad`` buffers exist beforehand and are the baseline, so the gradients
    the loss returns (added into them) count as extra: a stricter figure. ``values``: the features
    are rounded to that dtype first and megabatch's losses are told so (``values_in``)."""
    generator = torch.Generator(device=device).manual_seed(0)
    images = F.normalize(torch.randn(b_local, dim, device=device, generator=generator), dim=-1)
    texts = F.normalize(torch.randn(b_local, dim, device=device, generator=generator), dim=-1)
    if values is not None:
        images, texts = images.to(values), texts.to(values)
    images = images.to(dtype).requires_grad_()
    texts = texts.to(dtype).requires_grad_()
    scale = torch.tensor(100.0, device=device, requires_grad=True)
    if hasattr(loss_fn, "prepare"):  # a distillation loss's teacher features: inputs, not the loss's memory
        loss_fn.prepare(images)
    grad_bytes = 2 * images.numel() * images.element_size()
    times = []
    for _ in range(repeats):
        images.grad = texts.grad = scale.grad = None
        if preallocate:
            images.grad, texts.grad = torch.zeros_like(images), torch.zeros_like(texts)
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the inputs
        start = time.perf_counter()
        # the references take no hint
        told = {"values_in": values} if isinstance(loss_fn, ContrastiveLoss) or \
            getattr(loss_fn, "takes_values_in", False) else {}
        loss = loss_fn(images, texts, scale, **told)
        loss.backward()
        sync()
        times.append(time.perf_counter() - start)
        extra = torch.cuda.max_memory_allocated() - base - (0 if preallocate else grad_bytes)
        value = float(loss.detach())
        del loss
    images.grad = texts.grad = None
    return {"time_s": statistics.median(times), "times_s": times, "extra_gb": extra / 1e9,
            "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="vanilla,local,disco,infcl,ref_openclip,ref_infcl")
    parser.add_argument("--batches", default="32k,64k,128k,256k,1M", help="global batch sizes")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--tile", type=int, default=8192, help="infcl tile size")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs below 256k (1 above)")
    parser.add_argument("--budget-s", type=float, default=480, help="skip runs predicted past this")
    parser.add_argument("--tf32", type=int, default=1)
    parser.add_argument("--preallocate-grads", action="store_true",
                        help="stricter memory figure: .grad exists before the call (see measure)")
    parser.add_argument("--max-batch", default="", help="per backend: ref_infcl=128k,vanilla=64k")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    if world > 1 or "ref_infcl" in args.backends:  # inf_cl needs a process group even for one GPU
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("nccl", device_id=device)
    started = time.perf_counter()
    batches = [parse_count(b, "--batches") for b in args.batches.split(",")]
    max_batch = {k: parse_count(v, "--max-batch") for k, v in
                 (item.split("=") for item in args.max_batch.split(",") if item)}
    results = []
    for dtype_name in args.dtypes.split(","):
        for name in args.backends.split(","):
            try:
                loss_fn = make_backend(name, args.tile, world, rank, "tf32" if args.tf32 else "ieee")
            except ImportError as error:
                results.append({"backend": name, "status": f"unavailable: {error}"})
                continue
            values = VALUES.get(dtype_name)
            measure(loss_fn, 4096 // world, args.dim, DTYPES[dtype_name], 1, device, values=values)  # warm-up
            last_time, prev, failed = None, None, False
            for batch in batches:
                row = {"backend": name, "dtype": dtype_name, "batch": batch, "gpus": world,
                       "dim": args.dim}
                # quadratic cost: predict from the last size; skip what would overrun the budget
                predicted = last_time * (batch / prev) ** 2 if last_time else 0
                elapsed = time.perf_counter() - started
                if failed:
                    row["status"] = "skipped: out of memory at a smaller batch"
                elif batch > max_batch.get(name, batch):
                    row["status"] = f"skipped: above --max-batch {max_batch[name]}"
                elif elapsed + predicted > args.budget_s:
                    row["status"] = f"skipped: predicted {predicted:.0f} s exceeds the budget"
                else:
                    try:
                        repeats = args.repeats if batch < 262144 else 1
                        row.update(measure(loss_fn, batch // world, args.dim, DTYPES[dtype_name],
                                           repeats, device, args.preallocate_grads, values))
                        row["status"] = "ok"
                        row["useful_tflops"] = 6 * batch * batch * args.dim / row["time_s"] / 1e12 / world
                        last_time, prev = row["time_s"], batch
                    except torch.cuda.OutOfMemoryError:
                        row["status"] = "out of memory"
                        failed = True
                    torch.cuda.empty_cache()
                if dist.is_initialized() and world > 1:  # every rank agrees on skips
                    flags = [None] * world
                    dist.all_gather_object(flags, row.get("status"))
                    if any(f == "out of memory" for f in flags):
                        row["status"], failed = "out of memory", True
                results.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                    write_results(args.out, results, tf32=bool(args.tf32), tile=args.tile,
                                  preallocate_grads=args.preallocate_grads)  # a run cut short keeps its rows
    if rank == 0:
        write_results(args.out, results, tf32=bool(args.tf32), tile=args.tile,
                      preallocate_grads=args.preallocate_grads)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
