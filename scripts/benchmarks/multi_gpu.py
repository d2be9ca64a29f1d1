"""Several GPUs as users launch them: ``torchrun --nproc_per_node=N train.py ...`` on JPEG shards, at
each GPU count and batch asked for, beside OpenCLIP 3.3's own trainer under ``torchrun`` with its
best settings at that batch; every step's samples/s, MFU, phases and peak memory, in one JSON.

    python scripts/benchmarks/multi_gpu.py --gpus 4,2,1 --batch 32k --openclip --openclip-gpus 4 --steps 9 \\
        --out vit_b32_32k_gpus.json
    python scripts/benchmarks/multi_gpu.py --gpus 4 --batch 1M --steps 4 --warmup-steps 1 --epoch-samples 4200000 \\
        --set data.decode=gpu model.compile=true trainer.sub_batch=auto trainer.offload=true --out 1m_4gpu.json
    python scripts/benchmarks/multi_gpu.py --gpus 4 --batch 32k --steps 10 \\
        --variant 'decode-ahead-8gb: data.decode_ahead_gb=8' --variant 'fsdp: trainer.parallel=fsdp' --out variants.json
    python scripts/benchmarks/multi_gpu.py --gpus 1 --batch 32k --steps 5 --stored-teacher ViT-L-14 --variant plain: \\
        --variant 'stored: distill.teacher=stored data.train.teacher_key=teacher.npy' --out stored_teacher.json
    python scripts/benchmarks/multi_gpu.py --gpus 1 --batch 4k --steps 3 --warmup-steps 1 --timeout-s 150 \\
        --variant 'distill-vit-l14: distill.teacher=ViT-L-14 distill.compile=false' --openclip --openclip-distill \\
        ViT-L-14 --openclip-batch 2k,3k,4k --openclip-timeout-s 110 --out distill_peak_memory_vs_openclip.json
    python scripts/benchmarks/multi_gpu.py --gpus 1 --batch 32k --steps 5 --arch ViT-B-16 --size 256 \
        --stored-image-features --set data.decode=gpu model.compile=true trainer.sub_batch=auto model.lock_image=true \
        --variant 'tower:' --variant 'stored: model.image_features=stored data.train.image_features_key=image.npy \
        data.decode=auto' --out lit_stored_vs_tower.json
    python scripts/benchmarks/multi_gpu.py --gpus 1 --batch 32k --steps 5 --negatives 16 --variant 'plain:' \\
        --variant 'negatives-4: data.train.negatives_key=json:negatives data.train.negatives=4' --out negatives.json
    python scripts/benchmarks/multi_gpu.py --gpus 1 --batch 1M --steps 1 --warmup-steps 0 --epoch-samples 1100000 \\
        --counts stats --cold --set data.decode=gpu model.compile=true trainer.sub_batch=auto trainer.offload=true \\
        --out 1m_first_step_cold_stats.json

``--set`` replaces its default (``data.decode=gpu model.compile=true trainer.sub_batch=auto``): repeat those
with it.

Our side: ``--images`` distinct photo-like JPEGs (``--size`` px) written once as shards, listed
again under more names (hard links) until an epoch holds ``--epoch-samples``: an epoch of a few steps, so the
run crosses epoch boundaries as a small set makes it. The trainer learns the shards' counts from a ``sizes.json``
beside them, or with ``--counts stats`` from img2dataset's ``<shard>_stats.json`` beside each, or with ``--counts
none`` by counting them itself. ``--cold``: each of our runs with empty caches of its own (``$MEGABATCH_CACHE``,
inductor's, Triton's), as on a fresh machine; every row has the run's ``time_to_first_step_s`` and its
``startup_s`` (rank 0's ``status.json``). Each run is ``torchrun --standalone --nproc_per_node=N train.py`` with
``trainer.log_every=1`` (one ``metrics.jsonl`` record a step: samples/s, MFU, phases, the peak GPU memory of rank 0)
and ``--set``/``--variant`` overrides; ``nvidia-smi`` is sampled meanwhile for every GPU's peak memory in use (the
same figure for both trainers).

OpenCLIP's side (``--openclip``): ``open_clip_train.main`` under ``torchrun`` with ``--dataset-type
synthetic`` (no JPEG decoding: its data costs it less than ours costs us), ``--precision amp_bf16
--local-loss --gather-with-grad --torchcompile``, ``--batch-size`` per GPU of ``--openclip-sub-batch``
(``--accum-freq`` for the rest of the per-GPU batch) and ``--log-every-n-steps 1``; its per-step
samples/s are parsed from its log, MFU computed with our run's FLOPs per sample and GPU peak.
torchrun's parser refuses OpenCLIP's ``--logs`` (a prefix of its ``--logs-specs``), so this file is
also the small script torchrun starts, which passes OpenCLIP its arguments (``--openclip-worker``).

Steady figures leave out the first ``--warmup-steps`` steps (compilation, tuning); the step-by-step
lists keep them. Each run is written to ``--out`` as it ends. Sent SIGTERM (an outer ``timeout``), the
harness stops the run in progress, writes the steps it logged (``returncode``: ``"stopped"``) and exits
without starting another.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
from processes import signal_tree, wait_gone  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER_ARGV = "MEGABATCH_OPENCLIP_ARGV"
PLAN_LINES = ("trainer.sub_batch=auto", "trainer.keep_graph", "FSDP:", "tuning the Triton", "decoded ahead",
              "data.worker_start", "counted the samples of", "the towers compiled in")


class GpuMemory:
    """Peak memory in use on each GPU, sampled through ``nvidia-smi`` (``None`` without one)."""

    def __init__(self, period_s: float = 0.5):
        self.period_s, self.peak_mb, self._stop = period_s, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
            except OSError:  # no nvidia-smi: nothing to sample
                return
            except subprocess.TimeoutExpired:  # a busy host: try again at the next period
                continue
            for line in out.strip().splitlines():
                index, used = (int(v) for v in line.split(","))
                self.peak_mb[index] = max(self.peak_mb.get(index, 0), used)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)

    def peaks_gb(self, gpus: int) -> list[float] | None:
        return [round(self.peak_mb[i] / 1024, 2) for i in range(gpus)] if self.peak_mb else None


def dataset(images: int, size: int, epoch_samples: int, workdir: Path, negatives: int = 0,
            stored_teacher: str | None = None, tower: tuple[str, Path] | None = None,
            aspects: tuple[float, ...] = (1.0,), counts: str = "sizes") -> str:
    """The shard pattern of an epoch of ``epoch_samples`` from ``images`` distinct JPEGs (with
    ``negatives`` more captions each in their JSON: ``data.train.negatives_key=json:negatives``; with
    ``stored_teacher``, an open_clip architecture with random weights, each sample's embeddings by it, as
    ``scripts/make_shards.py teacher`` writes them: ``distill.teacher=stored data.train.teacher_key=teacher.npy``;
    with ``tower`` (an architecture and its weights file), each sample's image features by its image tower, as
    ``scripts/make_shards.py image-features`` writes them: ``model.image_features=stored
    data.train.image_features_key=image.npy``, the images kept for the tower's own runs; ``aspects``: the images'
    width / height ratios, cycled, each of ``size``^2 px). ``counts``: how the shards' sample counts are given:
    ``sizes`` (``sizes.json`` beside them), ``stats`` (img2dataset's ``<shard>_stats.json`` beside each) or ``none``
    (the trainer counts them)."""
    if counts not in COUNTS:
        raise SystemExit(f"--counts {counts}: one of {', '.join(COUNTS)}")
    from megabatch.data.synthetic import photo_shards

    real_dir = workdir / ("distinct" if not negatives else f"distinct-negatives-{negatives}")
    if aspects != (1.0,):
        real_dir = real_dir.with_name(f"{real_dir.name}-aspects-{'-'.join(f'{a:g}' for a in aspects)}")
    listed = workdir / "listed"
    per_shard = min(1024, images)
    real = sorted(real_dir.glob("photo-*.tar")) or [Path(p) for p in photo_shards(images, size, real_dir, per_shard,
                                                                                  negatives, aspects)]
    sizes = json.loads((real_dir / "sizes.json").read_text())
    if stored_teacher:
        real = teacher_shards(real, real_dir.with_name(f"{real_dir.name}-teacher-{stored_teacher}"), stored_teacher)
    if tower:
        real = image_feature_shards(real, real_dir.with_name(f"{real_dir.name}-features-{tower[0]}"), *tower)
    count = -(-epoch_samples // per_shard)
    shutil.rmtree(listed, ignore_errors=True)
    listed.mkdir(parents=True)
    listed_sizes = {}
    for index in range(count):
        source = real[index % len(real)]
        name = f"shard-{index:06d}.tar"
        os.link(source, listed / name)
        listed_sizes[name] = sizes[source.name]
    if counts == "sizes":
        (listed / "sizes.json").write_text(json.dumps(listed_sizes))
    elif counts == "stats":  # as img2dataset writes them: 00042.tar's count in 00042_stats.json
        for name, size in listed_sizes.items():
            (listed / name.replace(".tar", "_stats.json")).write_text(json.dumps({"successes": size}))
    if stored_teacher:
        shutil.copy(real[0].parent / "teacher.json", listed / "teacher.json")
    if tower:
        shutil.copy(real[0].parent / "image_features.json", listed / "image_features.json")
    return str(listed / f"shard-{{000000..{count - 1:06d}}}.tar")


COUNTS = ("sizes", "stats", "none")


def cold_env(workdir: Path) -> dict:
    """This process's environment with every cache a run reads empty and its own (``$MEGABATCH_CACHE``, inductor's,
    Triton's home: ``bench.fresh_cache_env``): a cold start, as on a fresh machine."""
    from bench import fresh_cache_env

    root = workdir / f"cold-{time.time_ns()}"
    return fresh_cache_env(os.environ, root / "triton-home") | {
        "MEGABATCH_CACHE": str(root / "megabatch"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def teacher_shards(shards: list[Path], out: Path, arch: str) -> list[Path]:
    """``shards`` copied into ``out`` with ``arch``'s embeddings (random weights; timing only), once."""
    import torch
    from omegaconf import OmegaConf

    from megabatch.train.step.teacher import Teacher, load_teacher_model, write_teacher_shards

    if not (out / "teacher.json").exists() or len(list(out.glob("photo-*.tar"))) < len(shards):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = load_teacher_model(OmegaConf.create({"teacher": arch, "pretrained": None}))
        write_teacher_shards([str(s) for s in shards], out, [(arch, Teacher(model, 100.0, device))])
    return [out / s.name for s in shards]


def tower_weights(arch: str, workdir: Path) -> Path:
    """A weights file of ``arch`` with random weights (seed 0), written once: the locked tower of
    ``--stored-image-features``'s runs (``model.pretrained``) and of the features the shards store."""
    import open_clip
    import torch

    path = workdir / f"tower-{arch}.pt"
    if not path.exists():
        torch.manual_seed(0)
        torch.save(open_clip.create_model(arch).state_dict(), path)
    return path


def image_feature_shards(shards: list[Path], out: Path, arch: str, weights: Path) -> list[Path]:
    """``shards`` copied into ``out`` with the image features of ``arch``'s tower with ``weights``, once."""
    import torch
    from omegaconf import OmegaConf

    from megabatch.train.step.teacher import load_teacher_model, write_image_feature_shards

    if not (out / "image_features.json").exists() or len(list(out.glob("photo-*.tar"))) < len(shards):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = load_teacher_model(OmegaConf.create({"teacher": arch, "pretrained": str(weights)}))
        write_image_feature_shards([str(s) for s in shards], out, model, device)
    return [out / s.name for s in shards]


class Stop(Exception):
    """The harness itself was sent SIGTERM (an outer ``timeout``, a device's command limit)."""


# set once SIGTERM has stopped a run: the harness writes what that run logged, then starts no other
STOPPED = threading.Event()


def stop_on_sigterm() -> None:
    """SIGTERM raises ``Stop`` in the main thread (once; a second one ends the process as usual), so that the
    run in progress is stopped and its logged steps are written instead of lost with the harness."""
    def raise_stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Stop

    signal.signal(signal.SIGTERM, raise_stop)


def run_group(command: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | str, str]:
    """``command``'s exit status (``"timeout"`` past ``timeout_s``, ``"stopped"`` where the harness was sent
    SIGTERM meanwhile: ``STOPPED`` is then set) and its output. It runs in a process group of its own, which
    is stopped whole at the timeout: killing torchrun alone left its workers holding the GPUs, and the next run
    then ran out of memory beside them."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                               env=env, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout_s)
        return process.returncode, out
    except (subprocess.TimeoutExpired, Stop) as why:
        stopped = isinstance(why, Stop)
        if stopped:
            STOPPED.set()
        out, tree = "", set()
        # the group's processes and every process under the launcher (torchrun's workers are in sessions of their
        # own) 20 s to stop (5 s where the harness itself is being stopped), then killed
        for sig, grace in ((signal.SIGTERM, 5 if stopped else 20), (signal.SIGKILL, 20)):
            tree = signal_tree(process.pid, sig, tree)  # read while the launcher lives: its orphans leave the tree
            with contextlib.suppress(ProcessLookupError):  # the group had already exited
                os.killpg(process.pid, sig)
            start = time.monotonic()
            try:
                out, _ = process.communicate(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            if wait_gone(tree, grace - (time.monotonic() - start)):  # the launcher's orphans too
                break
        return "stopped" if stopped else "timeout", out


def steady(values: list[float], warmup: int) -> dict:
    rest = values[warmup:] or values
    if not rest:
        return {}
    median = statistics.median(rest)
    return {"median": median, "min": min(rest), "max": max(rest),
            "slowest_over_median": max(median / v for v in rest) if median else None}


def torchrun(gpus: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]


def run_ours(gpus: int, batch: str, urls: str, steps: int, overrides: list[str], workdir: Path, warmup: int,
             timeout_s: float, cold: bool = False) -> dict:
    run_dir = workdir / "runs" / f"ours-{gpus}gpu-{batch}-{time.time_ns()}"
    command = [*torchrun(gpus), str(ROOT / "train.py"), f"batch={batch}", "data=webdataset",
               f"data.train.urls={urls}", f"trainer.max_steps={steps}", "trainer.log_every=1",
               "trainer.ckpt_every=1000000", "eval=none", f"run_dir={run_dir}", *overrides]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    with GpuMemory() as memory:
        code, out = run_group(command, timeout_s, cold_env(workdir) if cold else None)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()] if (run_dir / "metrics.jsonl").exists() else []
    records = [r for r in records if "samples_per_s" in r]
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else out
    flops = re.search(r"([\d.]+) GFLOP per trained sample", log)
    peak = re.search(r"GPU peak ([\d.]+) TFLOP/s", log)
    row = {"system": "megabatch", "gpus": gpus, "batch": batch, "overrides": overrides, "command": " ".join(command),
           "returncode": code, "wall_s": round(time.perf_counter() - start, 1),
           "gflop_per_sample": float(flops[1]) if flops else None, "gpu_peak_tflops": float(peak[1]) if peak else None,
           "steps": [{"step": r.get("step"), "loss": r.get("loss"), "samples_per_s": r["samples_per_s"],
                      "mfu": r.get("mfu"),
                      "peak_gpu_gb": r.get("peak_gpu_gb"), "data_wait": r.get("data_wait"),
                      "phases_s": {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("time/")},
                      "decode_waits_s": {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("data_wait_s/")}}
                     for r in records],
           "gpu_memory_peak_gb": memory.peaks_gb(gpus), "cold_caches": cold}
    # from the process's start to its first finished step, and where that went (rank 0's status.json)
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    row["time_to_first_step_s"] = status.get("time_to_first_step_s")
    row["startup_s"] = {k.removeprefix("startup/"): v for k, v in status.get("startup_s", {}).items()}
    row["samples_per_s"] = steady([s["samples_per_s"] for s in row["steps"]], warmup)
    row["mfu"] = steady([s["mfu"] for s in row["steps"] if s["mfu"] is not None], warmup)
    # what the run decided at start-up: the sub-batch and kept graphs, FSDP's reduction, kernel tuning
    row["plan_log"] = [line.split(" - ", 1)[-1] for line in log.splitlines()
                       if any(key in line for key in PLAN_LINES)]
    if code != 0:
        row["log_tail"] = out[-4000:]
        row["error_lines"] = error_lines(out)
    return row


def error_lines(out: str) -> list[str]:
    """The lines of a failed run's output that name its error (an out-of-memory, a traceback's last line): the
    log's tail is often a compiler's statistics or torchrun's own traceback."""
    return [line[:400] for line in out.splitlines()
            if re.search(r"Error|error:|Aborted|terminate called|what\(\)", line)][-20:]


def openclip_teacher(arch: str, workdir: Path) -> list[str]:
    """OpenCLIP's ``--distill-model arch --distill-pretrained <file>`` for a teacher with random weights (timing
    and memory only; its trainer needs a weights file), the file written once under ``workdir``."""
    import open_clip
    import torch

    path = workdir / f"openclip-teacher-{arch}.pt"
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        torch.save(open_clip.create_model(arch, pretrained=None).state_dict(), path)
    return ["--distill-model", arch, "--distill-pretrained", str(path)]


def run_openclip(gpus: int, batch: int, sub_batch: int, arch: str, steps: int, workers: int, warmup: int,
                 basis: dict, timeout_s: float, extra: list[str], compile_: bool = True) -> dict:
    per_gpu = batch // gpus
    # OpenCLIP's distillation takes no gradient accumulation: the whole per-GPU batch at once
    micro = per_gpu if "--distill-model" in extra else min(sub_batch, per_gpu)
    argv = ["--model", arch, "--dataset-type", "synthetic", "--train-num-samples", str(batch * steps),
            "--batch-size", str(micro), "--accum-freq", str(per_gpu // micro), "--precision", "amp_bf16",
            "--local-loss", "--gather-with-grad", *(["--torchcompile"] if compile_ else []),
            "--epochs", "1", "--warmup", "0", "--lr", "5e-4", "--workers", str(workers), "--log-every-n-steps", "1",
            "--logs", "none", "--report-to", "", "--seed", "0", *extra]
    command = [*torchrun(gpus), str(Path(__file__).resolve()), "--openclip-worker"]
    print("$", f"{WORKER_ARGV}='{json.dumps(argv)}'", " ".join(command), flush=True)
    start = time.perf_counter()
    with GpuMemory() as memory:
        code, out = run_group(command, timeout_s, env={**os.environ, WORKER_ARGV: json.dumps(argv)})
    per_step = [float(v) for v in re.findall(r"Batch \(t\): [\d.]+, ([\d.e+]+)/s,", out)]
    row = {"system": "openclip", "gpus": gpus, "batch": batch, "openclip_argv": argv,
           "command": f"{WORKER_ARGV}='{json.dumps(argv)}' " + " ".join(command), "returncode": code,
           "wall_s": round(time.perf_counter() - start, 1),
           "steps": [{"step": i + 1, "samples_per_s": v} for i, v in enumerate(per_step)],
           "gpu_memory_peak_gb": memory.peaks_gb(gpus)}
    if basis.get("gflop_per_sample") and basis.get("gpu_peak_tflops"):
        for item in row["steps"]:  # our FLOP count of the same architecture and the same GPU peak
            item["mfu"] = item["samples_per_s"] / gpus * basis["gflop_per_sample"] / (basis["gpu_peak_tflops"] * 1e3)
    row["samples_per_s"] = steady(per_step, warmup)
    row["mfu"] = steady([s["mfu"] for s in row["steps"] if "mfu" in s], warmup)
    if code != 0 or not per_step:
        row["log_tail"] = out[-4000:]
        row["error_lines"] = error_lines(out)
    return row


def openclip_worker() -> None:
    """What torchrun starts for OpenCLIP: its ``main`` with the arguments the parent passed."""
    from open_clip_train.main import main

    main(json.loads(os.environ[WORKER_ARGV]))


def host_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main() -> None:
    if "--openclip-worker" in sys.argv:
        openclip_worker()
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts, in turn")
    parser.add_argument("--batch", default="32k", help="global batches, comma-separated, in turn")
    parser.add_argument("--model", default="openclip", help="our model option (model=...)")
    parser.add_argument("--arch", default="ViT-B-32", help="model.arch with --model openclip; OpenCLIP's --model")
    parser.add_argument("--loss", default="infcl")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--epoch-samples", type=int, default=160_000,
                        help="samples an epoch lists (the distinct images again and again)")
    parser.add_argument("--aspects", type=float, nargs="+", default=[1.0],
                        help="the images' width / height ratios, cycled (each --size^2 px): mixed aspect ratios")
    parser.add_argument("--workers", type=int, default=12, help="loader workers a rank (data.num_workers)")
    parser.add_argument("--counts", default="sizes", choices=COUNTS,
                        help="the shards' sample counts: sizes.json beside them, img2dataset's <shard>_stats.json "
                             "beside each, or none (the trainer counts them)")
    parser.add_argument("--cold", action="store_true",
                        help="our runs with empty caches of their own ($MEGABATCH_CACHE, inductor's, Triton's): a "
                             "cold start, its time_to_first_step_s in the row")
    parser.add_argument("--stored-teacher", default=None,
                        help="an open_clip architecture whose embeddings (random weights) the shards carry, for "
                             "distill.teacher=stored data.train.teacher_key=teacher.npy")
    parser.add_argument("--stored-image-features", action="store_true",
                        help="the shards also carry the image features of --arch's tower (random weights, written "
                             "once to a file every run loads: model.pretrained), for model.image_features=stored "
                             "data.train.image_features_key=image.npy (with model.lock_image=true)")
    parser.add_argument("--negatives", type=int, default=0,
                        help="more captions a sample in the JSON (data.train.negatives_key=json:negatives)")
    parser.add_argument("--set", nargs="*", default=["data.decode=gpu", "model.compile=true", "trainer.sub_batch=auto"],
                        help="our config overrides")
    parser.add_argument("--variant", action="append", default=[],
                        help="'name: override ...': a run per variant, each with --set and its own overrides")
    parser.add_argument("--openclip", action="store_true", help="also OpenCLIP's trainer at each GPU count and batch")
    parser.add_argument("--openclip-only", action="store_true",
                        help="OpenCLIP's runs alone (without MFU: ours gives the FLOPs)")
    parser.add_argument("--openclip-gpus", default=None, help="its GPU counts (default: --gpus)")
    parser.add_argument("--openclip-batch", default=None,
                        help="its global batches, comma-separated, tried after ours at the last --batch (default: "
                             "--batch, each beside ours); e.g. where it runs out of memory at ours")
    parser.add_argument("--openclip-sub-batch", type=int, default=1024, help="its --batch-size per GPU")
    parser.add_argument("--openclip-set", nargs="*", default=[], help="more OpenCLIP arguments")
    parser.add_argument("--openclip-distill", default=None,
                        help="OpenCLIP distilled from this architecture (random weights: --distill-model and a "
                             "written --distill-pretrained file), the whole per-GPU batch at once (its distillation "
                             "takes no --accum-freq)")
    parser.add_argument("--openclip-largest", action="store_true",
                        help="try --openclip-batch from the largest down and stop at the first that logs a step: "
                             "the largest batch OpenCLIP reaches on this machine, in as few runs as it takes")
    parser.add_argument("--openclip-eager", action="store_true",
                        help="OpenCLIP without --torchcompile (where its compilation takes longer than the run)")
    parser.add_argument("--timeout-s", type=float, default=540, help="per run")
    parser.add_argument("--openclip-timeout-s", type=float, default=None,
                        help="per OpenCLIP run (default: --timeout-s)")
    parser.add_argument("--workdir", default="/tmp/multi-gpu-bench")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    stop_on_sigterm()
    try:
        measure(args)
    except Stop:  # the runs written so far, and the stopped run's logged steps, are in --out
        print(f"stopped by SIGTERM: the runs so far are in {args.out}", file=sys.stderr, flush=True)
        keep_tuning(args.out)
        sys.exit(128 + signal.SIGTERM)
    keep_tuning(args.out)


def measure(args: argparse.Namespace) -> None:
    """Every run asked for, each written to ``args.out`` as it ends; ``Stop`` once a run was stopped by
    SIGTERM (``run_group``), after it was written."""
    from bench import write_results

    from megabatch.config import parse_count

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tower = (args.arch, tower_weights(args.arch, workdir)) if args.stored_image_features else None
    urls = None if args.openclip_only else dataset(args.images, args.size, args.epoch_samples, workdir, args.negatives,
                                                   args.stored_teacher, tower, tuple(args.aspects), args.counts)
    model = [f"model={args.model}", *([f"model.arch={args.arch}"] if args.model == "openclip" else []),
             *([f"model.pretrained={tower[1]}"] if tower else [])]
    common = [*model, f"loss={args.loss}", f"data.num_workers={args.workers}", *args.set]
    variants = [(name.strip(), rest.split()) for name, _, rest in (v.partition(":") for v in args.variant)] \
        or [(None, [])]
    results, basis = [], {}

    def keep(row: dict) -> None:
        """``row`` printed and written with the runs before it; then ``Stop`` if SIGTERM stopped it."""
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
        write_results(args.out, results, gpus=host_gpus(), images=args.images, size=args.size,
                      epoch_samples=args.epoch_samples)
        if STOPPED.is_set():
            raise Stop

    for batch in args.batch.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")) if not args.openclip_only else ():
            for name, extra in variants:
                row = run_ours(gpus, batch, urls, args.steps, [*common, *extra], workdir, args.warmup_steps,
                               args.timeout_s, cold=args.cold)
                row["variant"] = name
                basis = basis if not row.get("gflop_per_sample") else row
                keep(row)
        last = batch == args.batch.split(",")[-1]
        theirs = [batch] if not args.openclip_batch else args.openclip_batch.split(",") if last else []
        if args.openclip_largest:
            theirs = sorted(theirs, key=lambda b: parse_count(b, "--openclip-batch"), reverse=True)
        reached: set[int] = set()  # GPU counts at which a larger batch already logged a step (--openclip-largest)
        for their_batch in theirs if args.openclip or args.openclip_only else []:
            for gpus in (int(g) for g in (args.openclip_gpus or args.gpus).split(",")):
                if gpus in reached:
                    continue
                row = run_openclip(gpus, parse_count(their_batch, "--batch"), args.openclip_sub_batch, args.arch,
                                   args.steps, args.workers, args.warmup_steps, basis,
                                   args.openclip_timeout_s or args.timeout_s,
                                   [*args.openclip_set, *(openclip_teacher(args.openclip_distill, workdir)
                                                          if args.openclip_distill else [])],
                                   compile_=not args.openclip_eager)
                if args.openclip_largest and row["steps"]:
                    reached.add(gpus)
                keep(row)


def keep_tuning(out: str) -> None:
    """This host's Triton tuning beside ``out`` (``<out>.triton_tuned.json``): a GPU machine's cache is lost with it,
    and its tables are what ``kernels/tuned.json`` ships, so the next cold host does not tune again."""
    from megabatch.kernels.triton_tiles import tuning_cache_file

    if tuning_cache_file().exists():
        shutil.copy(tuning_cache_file(), Path(out).with_suffix(".triton_tuned.json"))


if __name__ == "__main__":
    main()
