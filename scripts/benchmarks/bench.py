"""What the benchmarks in ``scripts/benchmarks/`` share: GPU timing and memory helpers, the trainer's
step built without a run, OpenCLIP's own training loop, a profile's kernel summary, and one result
writer with one metadata schema.

Every benchmark writes ``{"meta": {...}, "results": [...]}`` through ``write_results``; ``meta``
records the command, the git commit, the GPU(s), the library versions and the time. A benchmark, run as
``python scripts/benchmarks/<name>.py``, has this folder on its path and imports it as ``from bench import
write_results``; it sits above the package and builds the trainer's step through its public functions.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout (scripts/benchmarks/bench.py): git's commit, the configs


def sync(device: torch.device) -> None:
    """Wait for the GPU (no-op on the CPU): around every timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_time(fn, warmup: int, repeat: int) -> float:
    """Median seconds of ``fn()`` on the GPU (CUDA events around each call), after ``warmup`` calls."""
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


# nvidia-smi's clock event (throttle) reasons, the bits of ``clocks_throttle_reasons.active`` (0x1, idle, left out)
CLOCK_REASONS = {0x2: "applications clocks", 0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)",
                 0x40: "thermal (hardware)", 0x80: "power brake", 0x100: "display clock"}


class ClockSampler:
    """The SM clock and power draw while a timed region runs, sampled every ``interval_ms`` by ``nvidia-smi`` (for
    one GPU): ``summary()`` after the ``with`` block gives the median, lowest and highest clock (MHz), the median
    power (W) and the reasons the driver named for holding the clock down. A share of the peak is a share of the
    FLOPs at the clock the peak assumes (an H100's and H200's 989 TFLOP/s: 1,830 MHz); under a power cap a kernel
    runs slower than it would alone (ncu's replays). Empty for a torch device that is not a GPU, and where there is
    no nvidia-smi or no sample."""

    QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"

    def __init__(self, device: torch.device | int = 0, interval_ms: int = 50, command: str = "nvidia-smi"):
        # nvidia-smi numbers every GPU of the machine, torch those CUDA_VISIBLE_DEVICES leaves: a torch device is
        # that list's entry (an index or a UUID, which nvidia-smi takes either way); an integer is nvidia-smi's own
        gpu, self.process, self.lines = device, None, []
        self.args = None  # a CPU: nothing to sample
        if isinstance(device, torch.device):
            if device.type != "cuda":
                return
            gpu = device.index or 0
            visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                       if entry.strip()]
            if gpu < len(visible):
                gpu = visible[gpu]
        self.args = [command, f"--id={gpu}", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                     f"--loop-ms={interval_ms}"]

    def __enter__(self) -> ClockSampler:
        if self.args is not None and shutil.which(self.args[0]) is not None:
            self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(0.2)  # its first sample before the region's work
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.lines = self.process.communicate(timeout=10)[0].splitlines()
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.lines = []

    def summary(self) -> dict:
        clocks, powers, reasons = [], [], 0
        for line in self.lines:
            parts = [part.strip() for part in line.split(",")]
            try:
                clocks.append(float(parts[0]))
                powers.append(float(parts[1]))
                reasons |= int(parts[2], 16)
            except (ValueError, IndexError):
                continue
        if not clocks:
            return {}
        return {"sm_mhz": statistics.median(clocks), "sm_mhz_min": min(clocks), "sm_mhz_max": max(clocks),
                "power_w": statistics.median(powers),
                "clock_limits": [name for bit, name in CLOCK_REASONS.items() if reasons & bit],
                "clock_samples": len(clocks)}


def peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

def trainer_step(cfg, device: str | torch.device = "auto"):
    """The ``TrainStep`` a run of ``cfg`` (a composed config with a numeric ``trainer.sub_batch``)
    trains with on this process's rank, built by the trainer's own builder (``train.parts.step_without_data``:
    trimming, FP8, FSDP, compilation and the loss's checks included) after the trainer's process-wide
    settings. No run directory, data or logging."""
    from megabatch.config.schema import validate
    from megabatch.data.loading import configure_loading
    from megabatch.distributed import init_distributed
    from megabatch.runtime.process import configure_backends
    from megabatch.train.build.parts import step_without_data

    cfg = validate(cfg)
    env = init_distributed(str(device) if isinstance(device, torch.device) else device)
    configure_backends(cfg, env.device)
    configure_loading(cfg.data, env.device)
    return step_without_data(cfg, env)


def openclip_training(batches: Iterator, batch: int, sub_batch: int, steps: int, device: torch.device,
                      warmup: int = 1, torchcompile: bool = False, arch: str = "ViT-B-32") -> dict:
    """OpenCLIP 3.3's own ``train_one_epoch`` on ``batches`` (``(images, texts)`` sub-batches, float
    images normalised): ``arch``, ``--precision amp_bf16 --batch-size <sub_batch> --accum-freq
    <batch / sub_batch> --local-loss --gather-with-grad`` and with ``torchcompile`` its
    ``--torchcompile`` (``torch.compile`` of the whole model, as its ``main`` does). ``warmup``
    untimed steps first (compilation happens there). Returns its steady step time and samples/s."""
    import itertools

    import open_clip
    from open_clip_train.params import parse_args
    from open_clip_train.train import train_one_epoch

    accum = batch // sub_batch
    args = parse_args(["--model", arch, "--precision", "amp_bf16", "--batch-size", str(sub_batch),
                       "--accum-freq", str(accum), "--local-loss", "--gather-with-grad", "--lr", "5e-4",
                       "--log-every-n-steps", "1000000"] + (["--torchcompile"] if torchcompile else []))
    args.device, args.distributed, args.world_size, args.rank, args.local_rank = str(device), False, 1, 0, 0
    args.wandb = args.tensorboard = False
    args.skip_scheduler = True
    args.distill = False
    model = open_clip.create_model(arch, precision="fp32", device=device, output_dict=True)
    loss = open_clip.create_loss(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    trained = torch.compile(model) if torchcompile else model

    class Data:  # what train_one_epoch reads: data["train"].dataloader (num_batches, num_samples)
        def __init__(self, num_batches):
            self.dataloader = self
            self.num_batches, self.num_samples = num_batches, num_batches * sub_batch

        def __iter__(self):
            return itertools.islice(batches, self.num_batches)

        def set_epoch(self, epoch):
            pass

    reset_peak(device)
    train_one_epoch(trained, {"train": Data(accum * warmup)}, loss, 0, optimizer, None, None, None, args)
    sync(device)
    start = time.perf_counter()
    train_one_epoch(trained, {"train": Data(accum * steps)}, loss, 1, optimizer, None, None, None, args)
    sync(device)
    elapsed = time.perf_counter() - start
    result = {"system": "openclip-3.3", "model": arch, "loss": "local", "batch": batch, "sub_batch": sub_batch,
              "accum_freq": accum, "torchcompile": torchcompile, "step_s": elapsed / steps,
              "samples_per_s": batch * steps / elapsed, "peak_gpu_gb": peak_gb(device)}
    del model, trained, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


KERNEL_CLASSES = (("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
                  ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "xmma", "matmul", "_mm_", "cublas")),
                  ("triton (fused elementwise / norms)", ("triton",)),
                  ("copies / casts", ("copy", "cast", "memcpy", "memset", "fill")))


def kernel_class(name: str) -> str:
    """A GPU kernel's class by its name (``KERNEL_CLASSES``; ``other`` if none)."""
    lowered = name.lower()
    for label, keys in KERNEL_CLASSES:
        if any(key in lowered for key in keys):
            return label
    return "other"


def kernel_summary(prof, wall_s: float, top: int = 15) -> dict:
    """What a ``torch.profiler.profile`` of a region of ``wall_s`` seconds ran on the GPU: kernel
    seconds per class and the ``top`` kernels, and the busy fraction (kernel time over wall time;
    overlapping streams can take it past 1)."""
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total / 1e6
    classes: dict[str, float] = {}
    for name, seconds in kernels.items():
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + seconds
    busy = sum(kernels.values())
    ranked = sorted(kernels.items(), key=lambda item: -item[1])[:top]
    return {"wall_s": wall_s, "kernel_s": busy, "busy_fraction": busy / wall_s,
            "classes_s": dict(sorted(classes.items(), key=lambda item: -item[1])),
            "top_kernels": [{"name": name[:120], "s": s} for name, s in ranked]}


def _git(*args: str, root: Path = ROOT, input: str | None = None) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30,
                              input=input).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _git_commit() -> str | None:
    """HEAD, with ``+dirty`` when the working tree differs from it (what ran is then not HEAD)."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


IGNORED_PARTS = ("__pycache__", ".pytest_cache", ".ruff_cache")  # what .gitignore keeps out of a source folder


def source_tree(folder: str | os.PathLike) -> str | None:
    """git's id of ``folder``'s tree as its files are now, computed without git: equal to ``git rev-parse
    <commit>:<folder>`` for the commit whose files these are. It names the code a run measured where the checkout's
    history does not (a copy of the working tree sent to a GPU machine can keep the commit it was first sent with, so
    ``git_commit`` there names a stale HEAD ``+dirty``); ``commit_of_tree`` finds the commit again. What git ignores in
    a source folder (``IGNORED_PARTS``, ``*.pyc``, ``*.egg-info``) is left out. None where ``folder`` is no folder."""
    import hashlib

    def tree(path: Path) -> bytes | None:
        entries = []
        for child in path.iterdir():
            if child.name in IGNORED_PARTS or child.name.endswith((".pyc", ".egg-info")):
                continue
            if child.is_symlink():
                mode, oid = b"120000", _object(b"blob", os.readlink(child).encode())
            elif child.is_dir():
                mode, oid = b"40000", tree(child)
                if oid is None:  # git keeps no empty folder
                    continue
            elif child.is_file():
                mode = b"100755" if os.access(child, os.X_OK) else b"100644"
                oid = _object(b"blob", child.read_bytes())
            else:
                continue
            # git orders a folder's entries by name, a subfolder's name as if it ended in "/"
            entries.append((child.name.encode() + (b"/" if mode == b"40000" else b""), mode, child.name.encode(), oid))
        if not entries:
            return None
        return _object(b"tree", b"".join(mode + b" " + name + b"\0" + oid for _, mode, name, oid in sorted(entries)))

    def _object(kind: bytes, body: bytes) -> bytes:
        return hashlib.sha1(kind + b" " + str(len(body)).encode() + b"\0" + body).digest()

    path = Path(folder)
    if not path.is_dir():
        return None
    oid = tree(path)
    return oid.hex() if oid is not None else None


def commit_of_tree(tree_id: str, folder: str = "src", root: Path = ROOT, depth: int = 2000) -> str | None:
    """The newest of the last ``depth`` commits whose ``folder`` is the tree ``tree_id`` (``source_tree``), else
    None: the commit a run on a copy of the working tree measured."""
    commits = (_git("log", "--format=%H", f"-n{depth}", root=root) or "").split()
    if not commits:
        return None
    listed = (_git("cat-file", "--batch-check", root=root,
                   input="".join(f"{commit}:{folder}\n" for commit in commits)) or "").splitlines()
    for commit, line in zip(commits, listed, strict=False):
        if line.split(" ")[0] == tree_id:
            return commit
    return None


def tree_ids(trees: str) -> dict[str, str | None]:
    """``name=src-path[@KEY=VALUE...]`` pairs (``run_trees``' argument) to each source folder's ``source_tree``."""
    ids = {}
    for pair in trees.split(","):
        name, _, rest = pair.partition("=")
        ids[name] = source_tree(rest.split("@")[0])
    return ids


@functools.cache
def _measured_ids(trees: str) -> dict[str, str | None]:
    """``tree_ids`` once a process: a benchmark rewrites its JSON after every row, and the code it measured is the
    code it started with."""
    return tree_ids(trees)


def host_record() -> dict:
    """The machine a result came from: its cores, architecture and CPU model (``/proc/cpuinfo``'s first ``model
    name``; else what ``platform`` says, or None). Hosts with the same GPU differ in how fast they compile and
    launch (an H100 host's cold start 32-39.5 s against another's 53-65 s for the same code, 2026-12-06)."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "cpu_model": model or platform.processor() or None}


def gpu_uuid() -> str | None:
    """The current CUDA device's UUID (nvidia-smi's ``GPU-...``), which tells whether two results ran on the same
    card; None without CUDA or where torch does not report it."""
    if not torch.cuda.is_available():
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except (AttributeError, RuntimeError):
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def metadata(**extra) -> dict:
    """The one metadata schema of every benchmark result (``trees``, ``run_trees``' argument: each tree's
    ``source_tree`` too, as ``tree_ids``)."""
    if isinstance(extra.get("trees"), str):
        extra = {**extra, "tree_ids": _measured_ids(extra["trees"])}
    cuda = torch.cuda.is_available()
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "open_clip", "torchvision"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            pass
    return {"command": shlex.join(sys.argv),  # a setting of several overrides stays one quoted argument
            "git_commit": _git_commit(), "src_tree": _measured_ids(f"src={ROOT / 'src'}")["src"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpus": int(os.environ.get("WORLD_SIZE", "1")) if cuda else 0,
            **({"gpu_uuid": gpu_uuid()} if cuda else {}),
            "host": host_record(), "versions": versions, **extra}


def write_results(path: str | os.PathLike, results: list, **meta) -> None:
    """Write ``{"meta": metadata(**meta), "results": results}`` to ``path`` (rewritten after every
    row, so a run cut short keeps what it measured)."""
    Path(path).write_text(json.dumps({"meta": metadata(**meta), "results": results}, indent=1))


def fresh_cache_env(environ, home: Path, installed_bytecode: str | None = None) -> dict:
    """``environ`` with Triton's home (its default caches) in an empty ``home`` and no
    ``TRITON_CACHE_DIR`` or bytecode folder (``megabatch/runtime/bytecode.py``) from this process: a run then
    keeps its Triton kernels and bytecode where megabatch puts them (``$MEGABATCH_CACHE/triton``,
    ``/pycache``) and finds none from another run of this benchmark elsewhere."""
    shutil.rmtree(home, ignore_errors=True)
    inherited = ("TRITON_CACHE_DIR", "PYTHONPYCACHEPREFIX", "MEGABATCH_PYCACHE_FOLDER")  # each run its own caches
    env = {k: v for k, v in environ.items() if k not in inherited} | {"TRITON_HOME": str(home)}
    if installed_bytecode:  # --installed-bytecode: the packages' bytecode, as pip compiles it when it installs them
        env["PYTHONPYCACHEPREFIX"] = installed_bytecode
    return env


def part_path(out: str, tree: str) -> str:
    """Where ``run_trees``' worker for ``tree`` writes its result (files beside it take it as their prefix)."""
    return f"{out}.{tree}.part"


def run_trees(script: str, trees: str, out: str, done=None) -> list:
    """Run ``script`` (with this process's arguments) once per ``name=src-path`` of ``trees`` (comma-separated), each in
    a process of its own with that ``src`` first on its ``PYTHONPATH``; ``name=src-path@KEY=VALUE`` also sets an
    environment variable for it (``@K1=V1@K2=V2`` several). The worker is called with ``--worker <pair> --out <part>``
    and writes its result (JSON) to ``part``. Returns the results in order, a tree that failed as
    ``{"tree": name, "status": "exit N"}``; ``done(results)`` after each tree (to write what is measured so far)."""
    results = []
    for pair in trees.split(","):
        name, _, rest = pair.partition("=")
        tree, *settings = rest.split("@")
        part = part_path(out, name)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
        for setting in settings:
            env[setting.partition("=")[0]] = setting.partition("=")[2]
        finished = subprocess.run([sys.executable, script, *sys.argv[1:], "--worker", pair, "--out", part], env=env)
        results.append(json.loads(Path(part).read_text()) if finished.returncode == 0 else
                       {"tree": name, "status": f"exit {finished.returncode}"})
        Path(part).unlink(missing_ok=True)
        if done is not None:
            done(results)
    return results
