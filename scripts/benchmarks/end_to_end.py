"""End to end: training steps on real JPEG shards (loader, GPU decoding, GradCache, loss, optimizer)
with data offload on and off, per variant of config overrides: time, phases, MFU, peak GPU and host
memory; optionally OpenCLIP 3.3's own training loop (any architecture) fed by the same loader.

    python scripts/benchmarks/end_to_end.py --batch 64k --sub-batch 512 --out offload.json
    python scripts/benchmarks/end_to_end.py --batch 1M --modes true --set data.decode=gpu model.compile=true \
        --out 1m.json
    python scripts/benchmarks/end_to_end.py --batch 32k --modes false --openclip \
        --set data.decode=gpu model.compile=true --out vs_openclip.json
    python scripts/benchmarks/end_to_end.py --batch 32k --sub-batch 1024,auto --openclip-sub-batch 512 --modes false \
        --openclip --set model.compile=true --out sub_batches_vs_openclip.json
    python scripts/benchmarks/end_to_end.py --model vit_b16 --batch 4k --modes false --openclip --steps 5 \
        --set data.decode=gpu model.compile=true --variant 'all-off: model.trim_text=false trainer.keep_graph=false' \
        --variant 'trim: trainer.keep_graph=false' --variant 'keep-graph: model.trim_text=false' --variant 'all-on:' \
        --out vit_b16_4k_vs_openclip.json
    python scripts/benchmarks/end_to_end.py --model vit_b16 --sub-batch 512 --kept-graph-counts 2,4,8,16,32,64 \
        --steps 2 --modes false --set data.decode=gpu model.compile=true --out kept_graph.json

Writes ``--images`` distinct JPEGs (``--size`` px, smooth random pictures, so they compress like
photos) as img2dataset shards under ``--workdir``, lists them repeatedly to reach the batch, and
runs ``--steps`` training steps with ``trainer.offload`` true and false: the run's own pieces
(``TrainData``, ``RunInputs``, ``Offload``, ``TrainStep``) without a run directory, with the config
overrides of ``--set`` (``data.decode=gpu``, ``model.compile=true``, ``trainer.sub_batch=auto``, ...).
MFU: the run's own figures (``train/step/utilization.py``). ``--openclip``: then OpenCLIP's
``train_one_epoch`` with ``--accum-freq batch / sub-batch`` (``--openclip-sub-batch`` where ours are
several or ``auto``) and its best flags (``--torchcompile``,
``--precision amp_bf16``; ``bench.openclip_training``) on the same loader's sub-batches. Host memory: the
peak, sampled every 0.5 s, of the proportional set size (PSS: shared pages split between the
processes sharing them) summed over this process and all its descendants (loader and re-decode
workers), and the peak drop of the machine's available memory below its level at the start.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import threading
import time
from pathlib import Path

import torch
from bench import write_results

from megabatch.config import parse_count
from megabatch.config.compose import compose
from megabatch.data.synthetic import photo_shards
from megabatch.runtime.process import configure_process


class HostMemory:
    """Background sampler of this process tree's summed PSS and of the machine's used memory."""

    def __init__(self, period_s: float = 0.5):
        self.period_s, self.peak_tree_gb, self.peak_used_gb = period_s, 0.0, 0.0
        self.baseline_kb = self._meminfo("MemTotal") - self._meminfo("MemAvailable")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _meminfo(key: str) -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        return 0

    @staticmethod
    def descendants() -> set[int]:
        """This process's descendants' pids."""
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        tree, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
            tree.update(children)
            frontier.extend(children)
        return tree - {os.getpid()}

    @classmethod
    def _tree_pss_kb(cls) -> int:
        total = 0
        for pid in cls.descendants() | {os.getpid()}:
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
            except OSError:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        self.peak_tree_gb = max(self.peak_tree_gb, self._tree_pss_kb() * 1024 / 1e9)
        used = self._meminfo("MemTotal") - self._meminfo("MemAvailable") - self.baseline_kb
        self.peak_used_gb = max(self.peak_used_gb, used * 1024 / 1e9)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class CpuUse:
    """CPU use sampled every ``period_s`` in a thread, given for a window as cores (CPU seconds per
    wall second): the machine's busy cores (``/proc/stat``), this process's threads by name
    (Python's names where a thread has one) and its descendants' (the loader's workers): which side
    of the host a data wait is on."""

    def __init__(self, period_s: float = 1.0):
        self.period_s, self.samples = period_s, [self._snapshot()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(self._snapshot())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _ticks(stat: str) -> int:
        fields = stat.rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    @classmethod
    def _snapshot(cls) -> tuple[float, int, dict, int]:
        machine = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        busy = sum(machine) - machine[3] - machine[4]  # all but idle and iowait
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        threads: dict[str, int] = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                task = Path(f"/proc/self/task/{tid}")
                name = names.get(int(tid)) or task.joinpath("comm").read_text().strip()
                threads[name] = threads.get(name, 0) + cls._ticks(task.joinpath("stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
        children = 0
        for pid in HostMemory.descendants():
            try:
                children += cls._ticks(Path(f"/proc/{pid}/stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
        return time.perf_counter(), busy, threads, children

    def window(self, start: float, end: float) -> dict | None:
        """Use between the samples nearest ``start`` and ``end`` (``time.perf_counter``)."""
        samples = list(self.samples)
        first = min(samples, key=lambda sample: abs(sample[0] - start))
        last = min(samples, key=lambda sample: abs(sample[0] - end))
        if last[0] - first[0] < self.period_s:
            return None
        tick, seconds = os.sysconf("SC_CLK_TCK"), last[0] - first[0]
        cores = {name: (ticks - first[2].get(name, 0)) / tick / seconds for name, ticks in last[2].items()}
        return {"seconds": round(seconds, 1), "machine_busy_cores": round((last[1] - first[1]) / tick / seconds, 2),
                "machine_cores": os.cpu_count(),
                "workers_cores": round((last[3] - first[3]) / tick / seconds, 2),
                "main_process_threads_cores": {name: round(value, 2) for name, value in
                                               sorted(cores.items(), key=lambda item: -item[1]) if value >= 0.05}}


def cpu_by_phase(cpu: CpuUse, start: float, phases: dict) -> dict:
    """``cpu``'s use in each phase of a step that began at ``start`` (GradCache: phase 1 = its data
    wait and encoding, then the loss and the replay; a plain step: the whole step)."""
    if "encode" not in phases:
        return {"step": cpu.window(start, start + sum(phases.values()))}
    ends = list(itertools.accumulate([start + phases["data"] + phases["encode"], phases["loss"], phases["replay"]]))
    return {"phase1": cpu.window(start, ends[0]), "loss": cpu.window(ends[0], ends[1]),
            "replay": cpu.window(ends[1], ends[2])}


def build_parts(urls: list[str], batch: int, sub_batch, offload: bool, workers: int, device: str, steps: int,
                offload_dir: str | None = None, overrides: tuple[str, ...] = (), model: str = "vit_b32"):
    from megabatch.config.schema import validate
    from megabatch.data.loading import configure_loading
    from megabatch.distributed import init_distributed
    from megabatch.runtime.process import configure_backends
    from megabatch.train.build.parts import RunParts

    precision = "bf16" if device == "cuda" else "fp32"
    cfg = compose(f"model={model}", "loss=infcl", "data=webdataset", f"batch={batch}", "eval=none",
                  f"data.num_workers={workers}", f"trainer.sub_batch={sub_batch}", f"trainer.max_steps={steps}",
                  f"trainer.offload={str(offload).lower()}", f"trainer.precision={precision}", *overrides)
    cfg.data.train.urls = urls
    cfg.trainer.offload_dir = offload_dir if offload else None
    env = init_distributed(device)
    configure_backends(validate(cfg), env.device)  # as the Trainer does, before building
    configure_loading(cfg.data, env.device)
    return RunParts.build(cfg, env)


def host_syncs(step, sub_batches, epoch: int) -> dict:
    """One more step under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that made the
    host wait for the GPU, counted by where in megabatch it was called (the innermost megabatch
    frame) and by thread (the GPU decoding threads are not the step's)."""
    import traceback
    import warnings

    where: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "megabatch" in f.filename or "scripts" in f.filename]
        frame = frames[-1] if frames else None
        key = (f"{threading.current_thread().name}: " + (f"{Path(frame.filename).name}:{frame.lineno} "
               f"{frame.name}" if frame else f"{Path(filename).name}:{lineno}"))
        where[key] = where.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step.gradients(sub_batches, epoch=epoch)
            step.apply()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return dict(sorted(where.items(), key=lambda item: -item[1]))


def profile_steps(step, sub_batches, epoch: int, count: int = 3) -> dict:
    """``count`` more steps under ``torch.profiler`` (as the timed ones run: one sync at the end):
    the GPU's kernel time by class, its busy fraction (below 1: the GPU waited on the host), the
    host's time to queue each step, and the host operations that took the most of it."""
    from bench import kernel_summary, sync
    from torch.profiler import ProfilerActivity, profile

    sync(step.device)
    queued = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if step.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(count):
            begun = time.perf_counter()
            step.gradients(sub_batches, epoch=epoch)
            step.apply()
            queued.append(time.perf_counter() - begun)
        sync(step.device)
        wall = time.perf_counter() - start
    summary = kernel_summary(prof, wall)
    host = sorted(prof.key_averages(), key=lambda event: -event.self_cpu_time_total)[:12]
    summary.update(steps=count, host_queue_s=queued,
                   top_host_ops=[{"name": event.key[:120], "self_s": event.self_cpu_time_total / 1e6,
                                  "calls": event.count} for event in host])
    return summary


def allocator_counts(device: torch.device) -> dict:
    """The caching allocator's cumulative retries (an allocation that failed, freed the cache and
    tried again) and ``cudaFree`` calls; empty off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "cuda_frees": stats.get("num_device_free", 0)}


def run_steps(urls: list[str], batch: int, sub_batch, offload: bool, workers: int, device: str, steps: int,
              offload_dir: str | None = None, overrides: tuple[str, ...] = (), model: str = "vit_b32",
              sync_debug: bool = False, profile: bool = False, warmup_steps: int = 1, prime_s: float = 0.0,
              host_sample_s: float = 0.5) -> dict:
    """``steps`` optimizer steps; the first ``warmup_steps`` pay start-up (compilation, worker
    forks, CUDA graphs recorded), so the steady-state figures are over the later ones:
    ``steady_step_s`` is their wall time (from the end of the last warm-up step's GPU work to the
    end of the last one's) over their count. Between the
    steady steps nothing waits for the GPU but what the step itself waits for, as in a run, so a
    step's ``step_s`` is host time: when the host could start queueing the next. ``sync_debug``:
    then one untimed step that counts the host syncs (``host_syncs``); ``profile``: then three
    under the profiler (``profile_steps``). ``prime_s``: the first sub-batch is taken, then the loader
    and the GPU decoding run that long before the first step starts (their queues fill, as during a
    previous step's loss and replay in a run), so that one step times a run's later steps, not its
    workers' start-up. ``host_sample_s``: how often the peak host memory is sampled (each sample
    walks the page tables of every process of the tree, this one's included)."""
    from megabatch.data import gpu_decode
    from megabatch.train.step.utilization import utilization

    start = time.perf_counter()  # with model.compile=true, RunParts.build compiles the towers (ClipModel.warm_up)
    parts = build_parts(urls, batch, sub_batch, offload, workers, device, steps, offload_dir, overrides, model)
    step, plan, device = parts.step, parts.plan, torch.device(device)
    compile_s = time.perf_counter() - start if "model.compile=true" in overrides else 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    allocator_before = allocator_counts(device)
    inputs, per_step, cpu = parts.inputs(0), [], CpuUse()
    sub_batches = inputs
    try:
        if prime_s > 0:
            first = next(inputs)
            time.sleep(prime_s)
            sub_batches = itertools.chain([first], inputs)
        with HostMemory(host_sample_s) as host:
            steady_start = time.perf_counter()  # no warm-up step (--warmup-steps 0): every step is counted
            for index in range(steps):
                start, waits_before = time.perf_counter(), dict(gpu_decode.wait_seconds)
                _, phases = step.gradients(sub_batches, epoch=index // plan.steps_per_epoch)
                step.apply()
                phases = dict(phases)  # the phases' CUDA events read: waits for the replay's end (as its sync did)
                if device.type == "cuda" and index == min(warmup_steps, steps - 1) - 1:
                    torch.cuda.synchronize()  # the warm-up steps' own time (start-up)
                    steady_start = time.perf_counter()
                # the host queues the next step while the GPU finishes this one (as a run does):
                # a step's time is when the host could start the next, and the steady steps'
                # wall time ends with the GPU's last kernel
                per_step.append({"step_s": time.perf_counter() - start, "phases_s": phases,
                                 # the data wait's sides with GPU decoding: the loader, or the decoding
                                 "decode_waits_s": {key: value - waits_before.get(key, 0.0)
                                                    for key, value in gpu_decode.wait_seconds.items()},
                                 "cpu_cores": cpu_by_phase(cpu, start, phases)})
                print(json.dumps({"offload": offload, "batch": batch, **per_step[-1]}), flush=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            allocator_after = allocator_counts(device)
            steady_wall_s = time.perf_counter() - steady_start if steps > warmup_steps and device.type == "cuda" \
                else None
            syncs = host_syncs(step, sub_batches, steps // plan.steps_per_epoch) if sync_debug else None
            profiled = profile_steps(step, sub_batches, steps // plan.steps_per_epoch) if profile else None
    finally:  # also when a step raises: the loader's workers ignore stop signals, and exit would wait on them
        cpu.close()
        inputs.close()
        parts.close()
    later = per_step[warmup_steps:] or per_step
    step_s = steady_wall_s / len(later) if steady_wall_s else sum(s["step_s"] for s in later) / len(later)
    data_s = sum(s["phases_s"]["data"] for s in later) / len(later)
    row = {"system": "megabatch", "model": model, "overrides": list(overrides), "offload": offload,
           "offload_dir": offload_dir if offload else None, "batch": batch,
           "sub_batch": plan.sub_batch, "sub_batch_setting": str(sub_batch), "workers": workers,
           "steady_step_s": step_s, "steady_samples_s": batch / step_s, "steady_wall_s": steady_wall_s,
           **utilization(parts.flops, parts.peak, batch / step_s),
           "peak_tflops": parts.peak.tflops if parts.peak else None,
           "model_gflop_per_sample": parts.flops.per_sample / 1e9, "compile_s_untimed": compile_s,
           "steady_data_wait_fraction": data_s / step_s, "steps": per_step,
           "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
           # reserved: also the CUDA graphs' private pools (model.cuda_graphs), recorded before the reset
           "gpu_reserved_gb": torch.cuda.memory_reserved() / 1e9 if device.type == "cuda" else None,
           "warmup_steps": warmup_steps, "primed_s": prime_s, "host_sample_s": host_sample_s,
           # during the timed steps: a retry frees the cache (cudaFree, which waits for the whole GPU)
           "gpu_allocator_during_steps": {k: allocator_after[k] - allocator_before[k] for k in allocator_before},
           "peak_host_gb_process_tree_pss": host.peak_tree_gb,
           "peak_host_gb_machine_used_above_start": host.peak_used_gb, "host_syncs_one_step": syncs,
           "profile": profiled}
    del step, parts
    return row


def kept_graph_sweep(urls: list[str], counts: list[int], sub_batch: int, workers: int, device: str, rounds: int,
                     overrides: tuple[str, ...] = (), model: str = "vit_b32") -> list[dict]:
    """What ``trainer.keep_graph`` saves at K sub-batches a step (one of K replay forwards), for each
    K of ``counts``, on one built step (no offload): one warm-up step at K, then ``rounds`` pairs of
    steps with the kept graph on and off, interleaved so that drift of the machine falls on both.
    Each step is timed to the end of its GPU work; a row per (K, on/off) with the median step, the
    saving and the peak GPU memory (the kept graph holds one sub-batch's activations through the loss)."""
    import dataclasses
    import statistics

    from megabatch.train.step.utilization import utilization

    cuda = device == "cuda"
    parts = build_parts(urls, max(counts) * sub_batch, sub_batch, False, workers, device,
                        (1 + 2 * rounds) * len(counts), None, overrides, model)
    step, rows = parts.step, []
    inputs = parts.inputs(0)
    keep = step.keep
    try:
        for count in counts:
            step.sub_batches, step.one_pass = count, count == 1
            times: dict[bool, list[float]] = {True: [], False: []}
            peaks: dict[bool, float] = {True: 0.0, False: 0.0}
            for kept in [True] + [True, False] * rounds:
                step.keep = dataclasses.replace(keep, kept_graphs=int(kept))
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                step.gradients(inputs)
                step.apply()
                if cuda:
                    torch.cuda.synchronize()
                    peaks[kept] = max(peaks[kept], torch.cuda.max_memory_allocated() / 1e9)
                times[kept].append(time.perf_counter() - start)
            for kept in (True, False):
                timed = times[kept][1:] if kept else times[kept]  # the first kept step is the warm-up
                step_s = statistics.median(timed)
                rows.append({"system": "megabatch", "model": model, "overrides": list(overrides),
                             "sweep": "keep_graph", "sub_batches": count, "sub_batch": sub_batch,
                             "batch": count * sub_batch, "keep_graph": kept, "steady_step_s": step_s,
                             "step_s": timed, "steady_samples_s": count * sub_batch / step_s,
                             **utilization(parts.flops, parts.peak, count * sub_batch / step_s),
                             "peak_gpu_gb": peaks[kept] if cuda else None})
            on, off = rows[-2]["steady_step_s"], rows[-1]["steady_step_s"]
            rows[-2]["saved_fraction"] = 1 - on / off
            print(json.dumps({"sub_batches": count, "kept_s": on, "not_kept_s": off, "saved": 1 - on / off}),
                  flush=True)
    finally:
        step.keep = keep
        inputs.close()
        parts.close()
    return rows


OPENCLIP_ARCHS = {"vit_b32": "ViT-B-32", "vit_b16": "ViT-B-16", "vit_l14": "ViT-L-14"}  # our shapes' open_clip names


def openclip_on_our_loader(urls: list[str], batch: int, sub_batch: int, workers: int, steps: int,
                           overrides: tuple[str, ...], model: str = "vit_b32", arch: str | None = None,
                           warmup_steps: int = 1) -> dict:
    """OpenCLIP 3.3's training loop with its best flags, fed by our loader (the same shards, workers
    and ``--set`` data options; images normalised on the GPU as our model does), training ``arch``
    (default: the open_clip architecture of our ``model``)."""
    from bench import openclip_training

    from megabatch.models.images import normalize_images

    parts = build_parts(urls, batch, sub_batch, False, workers, "cuda", steps + 1, None, overrides, model)
    arch = arch or parts.model.arch or OPENCLIP_ARCHS[model]
    device, mean, std = torch.device("cuda"), parts.model.preprocess["mean"], parts.model.preprocess["std"]
    sub_batches = parts.inputs(0)
    stream = ((normalize_images(sub.images.to(device, non_blocking=True), mean, std),
               sub.texts.to(device, non_blocking=True)) for sub in sub_batches)
    row = openclip_training(stream, batch, sub_batch, max(1, steps - warmup_steps), device, warmup=warmup_steps,
                            torchcompile=True, arch=arch)
    sub_batches.close()
    parts.close()
    return {**row, "workers": workers, "overrides": list(overrides), "loader": "megabatch (same as ours)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="64k")
    parser.add_argument("--sub-batch", default="512",
                        help="a number, or auto (trainer.sub_batch=auto); several, comma-separated, run in turn")
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--modes", default="true,false", help="offload settings to run, in order")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=1, help="steps per mode; later ones are steady state")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="of --steps, the first ones left out of the steady figures, on both sides "
                             "(OpenCLIP's too)")
    parser.add_argument("--prime-s", type=float, default=0.0,
                        help="let the loader and the GPU decoding fill their queues this long before the first "
                             "step (as a previous step's loss and replay let them in a run)")
    parser.add_argument("--host-sample-s", type=float, default=0.5,
                        help="period of the peak host memory sampling (its /proc/<pid>/smaps_rollup reads walk "
                             "each process's page tables: ~0.4 of a core at 1M, and the kernel holds the "
                             "process's memory-map lock meanwhile)")
    parser.add_argument("--workdir", default="/tmp/offload-bench")
    parser.add_argument("--offload-dir", default=None, help="trainer.offload_dir: kept bytes in a file there")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for our runs, e.g. data.decode=gpu")
    parser.add_argument("--model", default="vit_b32", help="our model option (model=...)")
    parser.add_argument("--variant", action="append", default=[],
                        help="'name: override override ...': a row per variant, each with --set and its own overrides "
                             "(e.g. 'exact-off: model.trim_text=false trainer.keep_graph=false'); default one row")
    parser.add_argument("--openclip", action="store_true", help="then OpenCLIP 3.3 with --torchcompile on our loader")
    parser.add_argument("--openclip-arch", default=None, help="its architecture (default: our --model's)")
    parser.add_argument("--openclip-sub-batch", type=int, default=None,
                        help="OpenCLIP's micro-batch (--accum-freq batch / this; default: --sub-batch, a number)")
    parser.add_argument("--sync-debug", action="store_true",
                        help="then one untimed step per row counting host syncs (torch.cuda.set_sync_debug_mode)")
    parser.add_argument("--profile", action="store_true",
                        help="then three untimed steps per row under torch.profiler: GPU kernel time by class, "
                             "busy fraction, the host's time to queue a step and its costliest operations")
    parser.add_argument("--kept-graph-counts", default=None,
                        help="instead of the rows above: trainer.keep_graph on against off at these numbers of "
                             "sub-batches a step (e.g. 2,4,8,16,32,64), --steps pairs each, on one built step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    configure_process()  # what train.py sets first, before CUDA starts: the decoding streams' queues
    sub_batches = args.sub_batch.split(",")
    openclip_sub_batch = args.openclip_sub_batch or (int(sub_batches[0]) if sub_batches[0].isdigit() else None)
    if args.openclip and openclip_sub_batch is None:
        parser.error("--openclip with --sub-batch auto needs --openclip-sub-batch (OpenCLIP's micro-batch)")
    batch = parse_count(args.batch, "--batch")
    shards = photo_shards(args.images, args.size, Path(args.workdir) / "shards")
    mean_kb = sum(Path(s).stat().st_size for s in shards) / args.images / 1e3
    # the same shards listed again until every (shard-split) loader worker can fill its share
    urls = shards * ((args.steps + 2) * -(-batch // args.images) + args.workers // len(shards) + 1)
    if args.kept_graph_counts:
        counts = [int(c) for c in args.kept_graph_counts.split(",")]
        if not sub_batches[0].isdigit():
            parser.error("--kept-graph-counts needs a --sub-batch number")
        urls = shards * (((2 * args.steps + 1) * sum(counts) + max(counts)) * int(sub_batches[0]) // args.images
                         + args.workers + 1)
        rows = kept_graph_sweep(urls, counts, int(sub_batches[0]), args.workers, args.device, args.steps,
                                tuple(args.set), args.model)
        write_results(args.out, rows, jpeg_kb_per_sample=mean_kb)
        return
    variants = [(name.strip(), tuple(rest.split())) for name, _, rest in (v.partition(":") for v in args.variant)]
    results = []
    for mode in args.modes.split(","):
        for sub_batch in sub_batches:
            for variant, extra in variants or [(None, ())]:
                row = run_steps(urls, batch, sub_batch, mode == "true", args.workers, args.device, args.steps,
                                args.offload_dir, (*args.set, *extra), args.model, args.sync_debug, args.profile,
                                args.warmup_steps, args.prime_s, args.host_sample_s)
                row["variant"] = variant
                print(json.dumps(row), flush=True)
                results.append(row)
                write_results(args.out, results, jpeg_kb_per_sample=mean_kb)
    if args.openclip:
        row = openclip_on_our_loader(urls, batch, openclip_sub_batch, args.workers, args.steps, tuple(args.set),
                                     args.model, args.openclip_arch, args.warmup_steps)
        print(json.dumps(row), flush=True)
        results.append(row)
        write_results(args.out, results, jpeg_kb_per_sample=mean_kb)


if __name__ == "__main__":
    main()
