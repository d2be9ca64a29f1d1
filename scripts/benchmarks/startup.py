"""Time from the command to the first finished step, compiled, cold and warm, side by side with
OpenCLIP's ``--torchcompile``; and the steady-state samples/s after it.

    python scripts/benchmarks/startup.py --model vit_b16 --batch 256 --out startup.json
    python scripts/benchmarks/startup.py --model vit_l14 --batch 128 --scopes block --out startup_l14.json
    python scripts/benchmarks/startup.py --model vit_b16 --batch 256 --sweep-batches 512,1024,2048 \
        --before /tmp/before --out startup_sweep.json
    git archive HEAD~1 | (mkdir /tmp/before && tar -x -C /tmp/before)
    python scripts/benchmarks/startup.py --model vit_b16 --batch 4096 --images 4096 --steps 4 --scopes block \
        --before /tmp/before --out startup_before_after.json

Each row is one process, launched as a user launches it: ``python train.py model=<model>
model.compile=true model.compile_scope=<scope> data=webdataset data.decode=gpu ...`` on photo-like
JPEG shards written first (``--images``); with ``--before``, each row again from that source tree (or trees), the
trees taking turns at each of ``--caches``.
``cold``: an empty ``$MEGABATCH_CACHE``, an empty inductor
cache (``TORCHINDUCTOR_CACHE_DIR``) and an empty Triton home (``TRITON_HOME``: its default caches);
``warm``: the cache the cold run of that scope wrote, inductor's own cache and Triton's home empty
again (as a job on another node that shares ``$MEGABATCH_CACHE``).
``time_to_first_step_s`` is what the run wrote to ``status.json``, ``startup_s`` where it went;
``samples_per_s`` the median of its logged intervals after the first. ``--sweep-batches``: a 3-job
multirun's start-up instead, also from an earlier source tree (``--before``, e.g. ``git archive``'s).
OpenCLIP 3.3 (``--openclip``): its own ``train_one_epoch`` with
``--torchcompile --precision amp_bf16`` (``bench.openclip_training``) in a fresh process with an
empty inductor cache, the time from the process's start to the end of its first step; or
(``--openclip-main``) ``python -m open_clip_train.main`` itself, as its users launch it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import fresh_cache_env, source_tree, write_results

ROOT = Path(__file__).resolve().parents[2]
ARCH = {"vit_b32": "ViT-B-32", "vit_b16": "ViT-B-16", "vit_l14": "ViT-L-14"}

OPENCLIP = """
import sys, torch
from bench import openclip_training
from megabatch.data.synthetic import synthetic_sub_batch
from megabatch.runtime.signals import process_age_s
from itertools import repeat
batch, arch = int(sys.argv[1]), sys.argv[2]
sub = synthetic_sub_batch(batch, 336 if arch.endswith("336") else 224, 77, torch.device("cuda"))
result = openclip_training(repeat((sub.images, sub.texts)), batch, batch, 1, torch.device("cuda"), warmup=1,
                           torchcompile=True, arch=arch)
print("FIRST_STEP_S", process_age_s() - result["step_s"], "STEP_S", result["step_s"])
"""


def settled(folder: Path, quiet_s: float = 3.0, limit_s: float = 90.0) -> int:
    """Wait until no file has been added under ``folder`` for ``quiet_s`` (at most ``limit_s``): a
    run's background bytecode compiler (``megabatch/runtime/bytecode.py``) finishing, as it would have before a
    later job started. Returns the files there."""
    count, quiet, waited = -1, 0.0, 0.0
    while quiet < quiet_s and waited < limit_s:
        now = sum(1 for _ in folder.rglob("*.pyc")) if folder.is_dir() else 0
        quiet = quiet + 0.5 if now == count else 0.0
        count = now
        time.sleep(0.5)
        waited += 0.5
    return count


def run_log(out: str, scope: str, label: str, cache: str, index: int) -> Path:
    """``--logs``: where a row's run leaves its output, beside ``out``: ``<out>.<scope>-<label>.<cache>.<index>.log``
    (``index``: the row's, so that the same cache state run again has a file of its own)."""
    return Path(out).with_suffix(f".{scope}-{label}.{cache}.{index}.log")


def ours(args, scope: str, cache: str, workdir: Path, urls: str, profile: Path | None = None, tree: Path = ROOT,
         label: str = "now", sampled: Path | None = None, log_to: Path | None = None) -> dict:
    """One run of ``train.py`` with ``cache`` (cold or warm) caches; with ``profile``, under cProfile, its
    statistics written there (the profiler's cost is in the row's times); with ``sampled``, its main thread's stacks
    sampled into that file (``sample_stacks.py``). ``tree``: the source tree it runs from (``--before``'s, labelled
    ``label``: its own caches). ``log_to``: the run's output (its log) written there, and named in the row."""
    key = scope if label == "now" else f"{scope}-{label}"
    cache_dir, inductor = workdir / f"cache-{key}", workdir / f"inductor-{key}-{cache}"
    if cache == "cold":
        shutil.rmtree(cache_dir, ignore_errors=True)
    kept_bytecode = settled(cache_dir / "pycache") if cache == "warm" else 0  # cold: just emptied
    shutil.rmtree(inductor, ignore_errors=True)
    run_dir = workdir / f"run-{key}-{cache}"
    shutil.rmtree(run_dir, ignore_errors=True)
    profiler = ["-m", "cProfile", "-o", str(profile)] if profile else \
        [str(Path(__file__).with_name("sample_stacks.py")), str(sampled)] if sampled else []
    command = [sys.executable, *profiler, str(tree / "train.py"), f"model={args.model}", "model.compile=true",
               f"model.compile_scope={scope}", "data=webdataset", f"data.train.urls={urls}",
               f"data.decode={args.decode}", f"data.num_workers={args.workers}", f"batch={args.batch}",
               f"trainer.max_steps={args.steps}",
               "trainer.log_every=1", "eval=none", f"run_dir={run_dir}", *args.set]
    env = fresh_cache_env(os.environ, workdir / f"triton-home-{key}-{cache}", args.installed_bytecode) | {
        "MEGABATCH_CACHE": str(cache_dir), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    ran = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if log_to is not None:
        log_to.write_text(ran.stdout + ran.stderr)
    row = {"system": "megabatch" if label == "now" else f"megabatch ({label})", "model": args.model,
           "batch": args.batch, "scope": scope, "cache": cache,
           **({"profiled": True} if profile else {}), **({"sampled": True} if sampled else {}),
           **({"log": log_to.name} if log_to is not None else {}),
           "kept_bytecode_files": kept_bytecode,
           "returncode": ran.returncode, "wall_s": wall,
           "command": " ".join(command[1:])}
    if ran.returncode != 0:
        return row | {"error": ran.stderr[-2000:]}
    status = json.loads((run_dir / "status.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records[1:] if "samples_per_s" in r]
    lines = (ran.stdout + ran.stderr).splitlines()
    compiled = [line for line in lines if "the towers compiled in" in line]
    notes = [line.split(" - ", 1)[-1] for line in lines if "bytecode" in line or "TRITON_CACHE_DIR" in line]
    return row | {"time_to_first_step_s": status.get("time_to_first_step_s"),
                  "startup_s": {k.removeprefix("startup/"): v for k, v in status.get("startup_s", {}).items()},
                  "compile_log": compiled[-1].split(" - ")[-1] if compiled else None,
                  "first_step": first_step_waits(records),
                  "notes": notes,
                  "samples_per_s": statistics.median(rates) if rates else None}


def first_step_waits(records: list[dict]) -> dict | None:
    """The first step's phases and, with the GPU decoding, where its wait for images went (``look_ahead_source``: the
    loader had not read them; ``look_ahead_decode``: their decoding had not finished), from its metrics record."""
    first = next((r for r in records if r.get("step") == 1), None)
    if first is None:
        return None
    return {"phases_s": {k.split("/", 1)[1]: v for k, v in first.items() if k.startswith("time/")},
            "decode_waits_s": {k.split("/", 1)[1]: v for k, v in first.items() if k.startswith("data_wait_s/")}}


def sweep(args, workdir: Path, urls: str, tree: Path, label: str) -> dict:
    """``python train.py -m batch=<--sweep-batches>`` (one multirun, its jobs one after another in one
    process) from the source tree ``tree``, caches cold. Each job's start-up: from the end of the job
    before it (the command's start for the first) to its first step's metrics record; the total wall."""
    cache_dir, inductor = workdir / f"cache-sweep-{label}", workdir / f"inductor-sweep-{label}"
    for folder in (cache_dir, inductor, tree / "runs" / f"sweep-{label}"):
        shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, str(tree / "train.py"), "-m", f"model={args.model}", "model.compile=true",
               "data=webdataset", f"data.train.urls={urls}", f"data.decode={args.decode}",
               f"data.num_workers={args.workers}", f"batch={args.sweep_batches}", f"trainer.sub_batch={args.batch}",
               f"trainer.max_steps={args.sweep_steps}", "trainer.log_every=1", "eval=none", f"name=sweep-{label}",
               *args.set]
    env = fresh_cache_env(os.environ, workdir / f"triton-home-sweep-{label}", args.installed_bytecode) | {
        "MEGABATCH_CACHE": str(cache_dir), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")])}
    started = time.time()
    row = {"system": f"megabatch ({label})", "model": args.model, "sweep": args.sweep_batches, "sub_batch": args.batch,
           "steps_per_job": args.sweep_steps, "command": " ".join(command[1:])}
    try:
        ran = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return row | {"returncode": None, "wall_s": time.time() - started, "error": f"timed out ({args.timeout} s)"}
    row |= {"returncode": ran.returncode, "wall_s": time.time() - started}
    if ran.returncode != 0:
        return row | {"error": ran.stderr[-2000:]}
    jobs, previous_end = [], started
    for job_dir in sorted((tree / "runs" / f"sweep-{label}").glob("[0-9]*"), key=lambda d: int(d.name)):
        status = json.loads((job_dir / "status.json").read_text())
        first = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[0])
        jobs.append({"job": int(job_dir.name), "first_step_after_s": first["time"] - previous_end,
                     "time_to_first_step_s": status.get("time_to_first_step_s")})
        previous_end = status["started"] + status["wall_s"]
    return row | {"jobs": jobs, "startup_total_s": sum(job["first_step_after_s"] for job in jobs)}


def openclip(args, workdir: Path) -> dict:
    env = fresh_cache_env(os.environ, workdir / "triton-home-openclip", args.installed_bytecode) | {
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor-openclip")}
    shutil.rmtree(workdir / "inductor-openclip", ignore_errors=True)
    started = time.perf_counter()
    ran = subprocess.run([sys.executable, "-c", OPENCLIP, str(args.batch),
                          ARCH.get(args.model, args.model)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=args.timeout)
    row = {"system": "openclip-3.3 --torchcompile", "model": ARCH.get(args.model, args.model), "batch": args.batch,
           "cache": "cold", "returncode": ran.returncode, "wall_s": time.perf_counter() - started}
    line = next((x for x in ran.stdout.splitlines() if x.startswith("FIRST_STEP_S")), None)
    if line is None:
        return row | {"error": ran.stderr[-2000:]}
    fields = line.split()
    return row | {"time_to_first_step_s": float(fields[1]), "samples_per_s": args.batch / float(fields[3])}


def openclip_main(args, workdir: Path) -> dict:
    """OpenCLIP 3.3 as its users launch it, ``python -m open_clip_train.main --dataset-type synthetic
    --torchcompile --precision amp_bf16`` (its data module needs pandas), with empty caches: the time
    from the command to its first ``Train Epoch`` log line, which ``--log-every-n-steps 1`` writes
    after each step once the step's loss is read; samples/s the median of the lines after the second."""
    logs, inductor = workdir / "openclip-main-logs", workdir / "inductor-openclip-main"
    for folder in (logs, inductor):
        shutil.rmtree(folder, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    arch = ARCH.get(args.model, args.model)
    command = [sys.executable, "-m", "open_clip_train.main", "--dataset-type", "synthetic", "--model", arch,
               "--batch-size", str(args.batch), "--train-num-samples", str(args.batch * args.steps), "--epochs", "1",
               "--precision", "amp_bf16", "--torchcompile", "--workers", str(args.openclip_workers),
               "--log-every-n-steps", "1", "--save-frequency", "0", "--logs", str(logs), "--name", "startup",
               *args.openclip_set]
    env = fresh_cache_env(os.environ, workdir / "triton-home-openclip-main", args.installed_bytecode) | {
        "TORCHINDUCTOR_CACHE_DIR": str(inductor), "PYTHONUNBUFFERED": "1"}
    row = {"system": "openclip-3.3 open_clip_train.main --torchcompile", "model": arch, "batch": args.batch,
           "cache": "cold", "command": " ".join(command[1:])}
    started = time.perf_counter()
    job = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Timer(args.timeout, job.kill)
    stop.start()
    steps, tail = [], []
    for line in job.stdout:
        tail = (tail + [line])[-40:]
        if "Train Epoch:" in line:
            rate = re.search(r"Batch \(t\): [0-9.]+, ([0-9.]+)/s", line)
            steps.append((time.perf_counter() - started, float(rate.group(1)) if rate else None))
    job.wait()
    stop.cancel()
    row |= {"returncode": job.returncode, "wall_s": time.perf_counter() - started}
    if not steps:
        return row | {"error": "".join(tail)[-2000:]}
    rates = [rate for _, rate in steps[2:] if rate is not None]
    return row | {"time_to_first_step_s": steps[0][0], "steps_logged": len(steps),
                  "samples_per_s": statistics.median(rates) if rates else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--scopes", default="block,tower", help="model.compile_scope values")
    parser.add_argument("--caches", default="cold,warm")
    parser.add_argument("--openclip", action="store_true",
                        help="OpenCLIP's train_one_epoch in a fresh process (bench.openclip_training)")
    parser.add_argument("--openclip-main", action="store_true",
                        help="OpenCLIP as its users launch it: python -m open_clip_train.main (needs pandas)")
    parser.add_argument("--openclip-workers", type=int, default=12, help="--workers of open_clip_train.main")
    parser.add_argument("--openclip-set", nargs="*", default=[], help="more open_clip_train.main arguments")
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--decode", default="gpu", help="data.decode (cpu for a dry run without a GPU)")
    parser.add_argument("--set", nargs="*", default=[], help="more train.py overrides")
    parser.add_argument("--workdir", default="/tmp/startup-bench")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--sweep-batches", default=None,
                        help="instead: a multirun over these batches (e.g. 512,1024,2048) at sub-batch --batch")
    parser.add_argument("--sweep-steps", type=int, default=3)
    parser.add_argument("--before", default=None,
                        help="also the runs (or, with --sweep-batches, the sweep) from this source tree (an earlier "
                             "revision, e.g. `git archive`'s), each after this tree's, on the same machine; several "
                             "trees (commas, not with --sweep-batches): each labelled by its folder's name")
    parser.add_argument("--installed-bytecode", default=None, metavar="DIR",
                        help="every run (OpenCLIP's too) reads the installed packages' bytecode from DIR "
                             "(PYTHONPYCACHEPREFIX), compiled there before: `PYTHONPYCACHEPREFIX=DIR python -m "
                             "compileall <site-packages> src`; for an image whose packages have none (pip installs "
                             "them with it)")
    parser.add_argument("--profile", action="store_true",
                        help="after the rows, one more warm run under cProfile (not in the JSON): its statistics in "
                             "<out>.<scope>.warm.prof and the slowest calls in <out>.<scope>.warm.txt. On Python 3.12 "
                             "the profile also holds the other threads' calls (the read-ahead's, the decoders'), so "
                             "the main thread's own times there include theirs")
    parser.add_argument("--sample", action="store_true",
                        help="after the rows, one more run (warm, or as --sample-cache says) with its main thread's "
                             "stack sampled every 5 ms (sample_stacks.py; not in the JSON): the samples in "
                             "<out>.<scope>.<cache>.samples.json and the seconds under each function in "
                             "<out>.<scope>.<cache>.samples.txt")
    parser.add_argument("--sample-cache", default="warm", choices=("warm", "cold"),
                        help="the caches of --sample's run (cold: empty, as a cold row's; the files then say cold)")
    parser.add_argument("--logs", action="store_true",
                        help="keep each row's run output (its log) beside --out, "
                             "<out>.<scope>-<tree>.<cache>.<row>.log (the row names its file)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from megabatch.data.synthetic import photo_shards

    workdir = Path(args.workdir)
    shards = photo_shards(args.images, 256, workdir / "shards", per_shard=512)
    urls = str(workdir / "shards" / f"photo-{{000000..{len(shards) - 1:06d}}}.tar")
    rows = []
    # each tree's code, as git's id of its src/ (bench.source_tree): which commit a row ran, whatever git says there
    ids = {label: source_tree(tree / "src") for tree, label in [(ROOT, "now"), *before_trees(args.before)]}
    if args.sweep_batches:
        trees = [(ROOT, "now")] + ([(Path(args.before), "before")] if args.before else [])
        for tree, label in trees:
            rows.append(sweep(args, workdir, urls, tree.resolve(), label))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"})[:800], flush=True)
            write_results(args.out, rows, installed_bytecode=args.installed_bytecode, tree_ids=ids)
        return
    for wanted, system in ((args.openclip, openclip), (args.openclip_main, openclip_main)):
        if wanted:
            rows.append(system(args, workdir))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"})[:600], flush=True)
            write_results(args.out, rows, installed_bytecode=args.installed_bytecode, tree_ids=ids)
    trees = [(ROOT, "now")] + before_trees(args.before)
    for scope in args.scopes.split(","):
        # the trees take turns at each cache state (cold: now, before; warm: now, before; ...): a machine whose speed
        # drifts during the call (on one H200 a warm start moved by 3 s within ten minutes) weighs on each alike
        for cache in args.caches.split(","):
            for tree, label in trees:
                log_to = run_log(args.out, scope, label, cache, len(rows)) if args.logs else None
                rows.append(ours(args, scope, cache, workdir, urls, tree=tree, label=label, log_to=log_to))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "command"})[:600], flush=True)
                write_results(args.out, rows, installed_bytecode=args.installed_bytecode, tree_ids=ids)
        if args.profile:
            profiled = Path(args.out).with_suffix(f".{scope}.warm.prof")
            row = ours(args, scope, "warm", workdir, urls, profile=profiled)
            print(json.dumps({k: v for k, v in row.items() if k != "command"})[:600], flush=True)
            write_profile_summary(profiled, profiled.with_suffix(".txt"))
        if args.sample:
            sampled = Path(args.out).with_suffix(f".{scope}.{args.sample_cache}.samples.json")
            row = ours(args, scope, args.sample_cache, workdir, urls, sampled=sampled)
            print(json.dumps({k: v for k, v in row.items() if k != "command"})[:600], flush=True)
            if sampled.exists():
                from sample_stacks import summary

                sampled.with_suffix(".txt").write_text(summary(str(sampled)) + "\n\n" + summary(str(sampled),
                                                                                               within="megabatch"))


def before_trees(before: str | None) -> list[tuple[Path, str]]:
    """``--before``'s source trees and their labels: one path is ``before``; several (commas) are each labelled by
    their folder's name."""
    paths = [Path(path).resolve() for path in before.split(",")] if before else []
    return [(path, "before" if len(paths) == 1 else path.name) for path in paths]


def write_profile_summary(profiled: Path, out: Path, lines: int = 60) -> None:
    """The profile's slowest calls, by cumulative and by own time, as text."""
    import io
    import pstats

    if not profiled.exists():
        return
    text = io.StringIO()
    stats = pstats.Stats(str(profiled), stream=text)
    stats.sort_stats("cumulative").print_stats(lines)
    stats.sort_stats("tottime").print_stats(lines)
    out.write_text(text.getvalue())


if __name__ == "__main__":
    main()
