"""Chaos: one training run under a seeded schedule of faults, checked against the same run without them.

    python scripts/benchmarks/chaos.py --ranks 2 --steps 24 --faults 6 --seed 0 --out chaos.json
    python scripts/benchmarks/chaos.py --ranks 4 --steps 200 --faults 50 --set model=openclip ... --out chaos_4gpu.json

Both runs are ``torchrun --nproc_per_node=<ranks> --max-restarts=<faults> train.py ... resume=latest`` as a user
launches them (the tiny model on the digits unless ``--set`` says otherwise; the run's checkpoints every
``--ckpt-every`` steps, written a little slower, ``--write-delay-s``, so that a fault can land inside a write). The
faults, drawn from ``--seed`` (kinds from ``--kinds``), each at a step of the run:

- ``kill-worker``: SIGKILL to one training process; torchrun restarts the workers, which resume from the newest
  checkpoint;
- ``kill-loader-worker``: SIGKILL to one of a rank's data-loading processes (the rank fails; torchrun restarts);
- ``requeue``: SIGTERM to the whole job (a scheduler's preemption): the run checkpoints and exits, and the same
  command runs again;
- ``lost-node``: SIGKILL to the launcher and its workers at once, then the same command again;
- ``kill-in-write``: the same, while a checkpoint is being written;
- ``corrupt-newest``: the same, then the newest checkpoint cut to half its size before the command runs again (a
  sharded one, ``--set trainer.parallel=fsdp``: its largest shard file), where an older one is there to resume from;
- ``other-ranks``: SIGTERM, then the command again on half the ranks (or twice as many from one): the run goes on
  from its checkpoint with the same samples in every step (``data.train.split=indexed``), but its sums are taken in
  another order, so from then on the weights are the run without faults' to rounding, not bitwise.

Checked: the final weights and optimizer state bitwise equal to the run without faults (after ``other-ranks``: the
weights within 1e-5 and every logged loss within 1e-6, relative, with the reason in the JSON); every step logged once;
no process of the run left, no shared memory (``/dev/shm``) it made and no GPU memory it held (``nvidia-smi``'s
processes, where there is one); each fault's steps redone at most ``--ckpt-every`` (two intervals where the newest
checkpoint was cut), and its seconds from the fault to the next step. Exit status 1 where a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
from processes import children, descendants  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("kill-worker", "kill-loader-worker", "requeue", "lost-node", "kill-in-write", "corrupt-newest", "other-ranks")
RUN = ["trainer.log_every=1", "eval=none", "model.image.patch_dropout=0", "data.train.shuffle_buffer=64",
       "data.train.split=indexed"]
WRAPPER = """
import os, runpy, sys, time
from pathlib import Path
import megabatch.checkpoint.files as files
real = files.save_checkpoint
def slowed(path, payload):  # a checkpoint write that takes a while, marked as it starts
    Path(os.environ["CHAOS_WRITING"]).touch()
    time.sleep(float(os.environ["CHAOS_WRITE_DELAY_S"]))
    real(path, payload)
files.save_checkpoint = slowed
sys.argv[0] = os.environ["CHAOS_TRAIN"]
runpy.run_path(os.environ["CHAOS_TRAIN"], run_name="__main__")
"""


class Job:
    """One training run's launches in ``workdir`` (``runs/<name>``), the same command each time."""

    def __init__(self, workdir: Path, name: str, args: argparse.Namespace):
        self.workdir, self.name, self.args = workdir, name, args
        self.run_dir = workdir / "runs" / name
        self.writing = workdir / f"{name}.writing"
        self.launches, self.process, self.ranks = 0, None, args.ranks

    def launch(self) -> None:
        args = self.args
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.ranks}",
                   f"--max-restarts={max(1, args.faults)}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                   str(self.workdir / "wrapper.py"), *RUN, f"name={self.name}", "resume=latest",
                   f"trainer.max_steps={args.steps}", f"trainer.ckpt_every={args.ckpt_every}", *args.set]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CHAOS_TRAIN": str(ROOT / "train.py"),
               "CHAOS_WRITING": str(self.writing), "CHAOS_WRITE_DELAY_S": str(args.write_delay_s)}
        log = open(self.workdir / f"{self.name}.log", "a")  # noqa: SIM115 - the launch's output, closed with it
        self.process = subprocess.Popen(command, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.launches += 1

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [record for line in path.read_text().splitlines() if "step" in (record := json.loads(line))]

    def steps(self) -> list[int]:
        return [record["step"] for record in self.records()]

    def wait_for_step(self, step: int, timeout: float) -> float:
        """Until step ``step`` is logged; the time it came."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.steps() and self.steps()[-1] >= step:
                return time.monotonic()
            if self.process.poll() is not None:
                raise RuntimeError(f"the run ended (status {self.process.returncode}) before step {step}")
            time.sleep(0.05)
        raise TimeoutError(f"no step {step} in {timeout:.0f} s")

    def resumes(self) -> list[int]:
        """The steps this run's launches (and torchrun's restarts) resumed at, in order, from its log (0: started
        afresh, no checkpoint written yet)."""
        log = self.workdir / f"{self.name}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return [0 if "starting fresh" in line else int(line.rsplit("at step ", 1)[1].split()[0]) for line in lines
                if ("resumed from" in line and "at step " in line) or "yet, starting fresh" in line]

    def wait_for_resume(self, before: int, timeout: float) -> int:
        """Until a resume beyond the first ``before`` is logged; the step it resumed at."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(resumes := self.resumes()) > before:
                return resumes[-1]
            if self.process.poll() is not None:
                raise RuntimeError(f"the run ended (status {self.process.returncode}) without resuming")
            time.sleep(0.05)
        raise TimeoutError(f"no resume in {timeout:.0f} s")

    def workers(self) -> list[int]:
        """The training processes (torchrun's children)."""
        return children(self.process.pid)

    def end(self, sig: int) -> None:
        """``sig`` to the launcher and every process under it at once (torchrun's workers are not in its process
        group: a scheduler signals them all, and a lost node loses them all); wait for the launch to end."""
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        self.process.wait(120)

    def finish(self, timeout: float) -> int:
        return self.process.wait(timeout)


def leftovers(workdir: Path) -> list[int]:
    """Processes still running a run of this harness (its wrapper, in ``workdir``, on their command line: another
    harness's runs elsewhere are not these)."""
    wrapper, found = str(workdir / "wrapper.py").encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if wrapper in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


SHARED_MEMORY = ("torch_", "sem.mp-", "psm_")  # torch's tensors between processes, multiprocessing's


def shared_memory() -> set[str]:
    """The names in ``/dev/shm`` that a training process makes (POSIX shared memory: torch's tensors between
    processes, the loaders' queues' semaphores, ``multiprocessing.shared_memory``)."""
    try:
        return {entry.name for entry in Path("/dev/shm").iterdir() if entry.name.startswith(SHARED_MEMORY)}
    except OSError:
        return set()


def mapped_by_live_processes(names: list[str]) -> set[str]:
    """Which of the ``/dev/shm`` ``names`` some live process has mapped (by inode, in ``/proc/<pid>/maps``: glibc maps
    a named semaphore under the temporary name it made it with). Checked after the run's processes are gone, these
    belong to other programs (another test's loader holding its semaphores meanwhile), not to the run."""
    inodes = {}
    for name in names:
        with contextlib.suppress(OSError):
            inodes[(Path("/dev/shm") / name).stat().st_ino] = name
    mapped = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and inodes:
            try:
                maps = (entry / "maps").read_text(errors="replace")
            except OSError:
                continue
            for line in maps.splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and "/dev/shm/" in fields[5] and fields[4].isdigit() \
                        and int(fields[4]) in inodes:
                    mapped.add(inodes[int(fields[4])])
    return mapped


def gpu_processes() -> list[int] | None:
    """The processes holding memory on this machine's GPUs (``nvidia-smi``), or ``None`` without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(line) for line in out.split() if line.strip().isdigit()]


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest numbered checkpoint (a ``.pt`` file, or a ``.dcp`` folder: ``trainer.parallel=fsdp``) where an older
    one is there to resume from; ``None`` where there is none or it is the only one (``last`` shares its bytes, so a
    cut one would leave nothing to resume from: ``resume=latest`` then stops, naming the damaged files, rather than
    start the run over)."""
    numbered = sorted([*(run_dir / "checkpoints").glob("step_*.pt"), *(run_dir / "checkpoints").glob("step_*.dcp")],
                      key=lambda path: path.stem)
    return numbered[-1] if len(numbered) > 1 else None


def cut(checkpoint: Path) -> str:
    """``checkpoint`` cut to half its size (a folder: its largest shard file); what was cut."""
    target = max(checkpoint.glob("*.distcp"), key=lambda path: path.stat().st_size) if checkpoint.is_dir() else \
        checkpoint
    os.truncate(target, target.stat().st_size // 2)
    return f"{checkpoint.name}/{target.name}" if checkpoint.is_dir() else checkpoint.name


def final_state(run_dir: Path) -> dict:
    """The run's last checkpoint as one state: ``model``, ``optimizer`` and ``step`` (a ``.dcp`` folder's shards read
    whole; its step from its ``meta.pt``)."""
    import torch

    checkpoints = run_dir / "checkpoints"
    if (checkpoints / "last.pt").exists():
        return torch.load(checkpoints / "last.pt", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megabatch.checkpoint.files import load_checkpoint

    whole = run_dir / "last-whole.pt"
    dcp_to_torch_save(checkpoints / "last.dcp", whole)
    state = torch.load(whole, weights_only=False)
    state["step"] = load_checkpoint(checkpoints / "last.dcp", weights=False)["step"]
    return state


def inject(job: Job, kind: str, rng: random.Random, timeout: float) -> str:
    """Put fault ``kind`` into the running ``job``; what was done."""
    if kind == "kill-worker":
        pid = rng.choice(job.workers())
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL to training process {pid}"
    if kind == "kill-loader-worker":
        loaders = [child for worker in job.workers() for child in children(worker)]
        if not loaders:
            return "no loader process to kill"
        pid = rng.choice(loaders)
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL to loader process {pid}"
    if kind in ("requeue", "other-ranks"):
        job.end(signal.SIGTERM)
        if kind == "other-ranks":
            job.ranks = job.ranks // 2 if job.ranks > 1 else 2
        job.launch()
        return "SIGTERM to the job, then the same command" + (f" on {job.ranks} ranks" if kind == "other-ranks" else "")
    if kind == "kill-in-write":
        started = job.writing.stat().st_mtime if job.writing.exists() else 0.0
        deadline = time.monotonic() + timeout
        while (not job.writing.exists() or job.writing.stat().st_mtime == started) and time.monotonic() < deadline:
            time.sleep(0.02)
    job.end(signal.SIGKILL)
    done = "SIGKILL to the launcher and its workers" + (" during a checkpoint write" if kind == "kill-in-write" else "")
    if kind == "corrupt-newest":
        newest = newest_checkpoint(job.run_dir)
        done += f", {cut(newest)} cut to half" if newest is not None else \
            ", none cut (no older checkpoint to resume from)"
    job.launch()
    return done + ", then the same command"


def compare(final: dict, reference: dict) -> list[str]:
    """What differs between two checkpoints' weights and optimizer states (empty: bitwise the same)."""
    import torch

    differences = [name for name, value in reference["model"].items() if not torch.equal(value, final["model"][name])]
    ours, theirs = final["optimizer"]["state"], reference["optimizer"]["state"]
    for key, state in theirs.items():
        for field, value in state.items():
            other = ours[key][field]
            if isinstance(value, torch.Tensor) and not torch.equal(value, other):
                differences.append(f"optimizer {key}.{field}")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--ckpt-every", type=int, default=2)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-delay-s", type=float, default=0.5)
    parser.add_argument("--timeout-s", type=float, default=300, help="the longest wait for one step")
    parser.add_argument("--set", nargs="*", default=["batch=64"], help="the run's own overrides")
    parser.add_argument("--workdir", default="/tmp/chaos")
    parser.add_argument("--out", default="chaos.json")
    args = parser.parse_args()
    import torch

    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    (workdir / "wrapper.py").write_text(WRAPPER)
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: {unknown[0]} is none of {', '.join(KINDS)}")
    at = sorted(rng.sample(range(args.ckpt_every + 1, args.steps), min(args.faults, args.steps - args.ckpt_every - 1)))
    schedule = [(step, rng.choice(kinds)) for step in at]

    shm_before, gpu_before = shared_memory(), gpu_processes()
    started = time.monotonic()
    straight = Job(workdir, "straight", args)
    straight.launch()
    straight.finish(args.timeout_s * args.steps)
    straight_s = time.monotonic() - started

    chaos, faults = Job(workdir, "chaos", args), []
    started = time.monotonic()
    chaos.launch()
    for step, kind in schedule:
        if chaos.process.poll() is not None or chaos.steps()[-1:] == [args.steps]:
            print(f"the run ended before step {step}'s {kind}", flush=True)
            break
        chaos.wait_for_step(step, args.timeout_s)
        resumes, logged, at_fault = len(chaos.resumes()), chaos.steps()[-1], time.monotonic()
        what = inject(chaos, kind, rng, args.timeout_s)
        if what.startswith("no "):  # nothing to strike (no loader process at that moment)
            faults.append({"step": logged, "kind": kind, "done": what})
            continue
        resumed = chaos.wait_for_resume(resumes, args.timeout_s)
        # the next step after the resume (none where it resumed at the last: a stop there checkpointed the end)
        back = chaos.wait_for_step(resumed + 1, args.timeout_s) if resumed < args.steps else time.monotonic()
        # the steps done again: those after the checkpoint it resumed from; a checkpoint interval, and another where the
        # newest checkpoint was still being written (asynchronous) or was cut, and one more may have ended as it struck
        allowed = args.ckpt_every * (3 if kind == "corrupt-newest" else 2) + 1
        faults.append({"step": logged, "kind": kind, "done": what, "resumed_at": resumed, "redone": logged - resumed,
                       "redone_at_most": allowed, "seconds_to_next_step": round(back - at_fault, 2)})
        print(f"step {logged}: {kind}: {what}; resumed at step {resumed}, its next step {back - at_fault:.1f} s "
              "after the fault", flush=True)
    status = chaos.finish(args.timeout_s * args.steps)
    chaos_s = time.monotonic() - started

    final, reference = final_state(chaos.run_dir), final_state(straight.run_dir)
    differences = compare(final, reference)
    logged = chaos.steps()
    left = leftovers(workdir)
    # new and still there after up to 10 s (a segment is unlinked by its maker, or by its resource tracker once the
    # processes that used it are gone: later on a loaded machine), and mapped by no live process (the run's are gone:
    # a live one's is another program's, made and held meanwhile: another test's loader)
    new, settled = shared_memory() - shm_before, time.monotonic() + 10.0
    while True:
        time.sleep(1.0)
        still = sorted(new & shared_memory())
        shm_left = sorted(set(still) - mapped_by_live_processes(still))
        if not shm_left or time.monotonic() > settled:
            break
    gpu_now = gpu_processes()
    gpu_left = sorted(set(gpu_now) - set(gpu_before or [])) if gpu_now is not None else None
    moved = any(fault["kind"] == "other-ranks" and "redone" in fault for fault in faults)
    if moved:  # another number of ranks sums in another order: the weights and losses to rounding
        names = list(reference["model"])
        weights = torch.cat([reference["model"][name].flatten().double() for name in names])
        ours = torch.cat([final["model"][name].flatten().double() for name in names])
        weight_error = float((ours - weights).norm() / weights.norm())
        losses = {record["step"]: record["loss"] for record in straight.records() if "loss" in record}
        loss_error = max(abs(record["loss"] - losses[record["step"]]) / abs(losses[record["step"]])
                         for record in chaos.records() if "loss" in record)
    checks = {
        "exit status 0": status == 0,
        "final step": final["step"] == reference["step"] == args.steps,
        **({"weights within 1e-5 and losses within 1e-6 (another number of ranks: sums in another order)":
            weight_error <= 1e-5 and loss_error <= 1e-6} if moved else
           {"weights and optimizer state bitwise the same": not differences}),
        "every step logged once": logged == list(range(1, args.steps + 1)),
        "no process left": not left,
        "no lock left": not (chaos.run_dir / ".lock").exists(),
        "no shared memory left": not shm_left,
        **({"no GPU memory left": not gpu_left} if gpu_left is not None else {}),
        "each fault's steps redone within its checkpoint interval": all(f["redone"] <= f["redone_at_most"]
                                                                         for f in faults if "redone" in f),
    }
    result = {"ranks": args.ranks, "steps": args.steps, "ckpt_every": args.ckpt_every, "seed": args.seed,
              "faults": faults, "launches": chaos.launches, "straight_s": round(straight_s, 1),
              "chaos_s": round(chaos_s, 1), "differences": differences[:10], "leftover_pids": left,
              "shared_memory_left": shm_left[:20], "gpu_processes_left": gpu_left, "checks": checks,
              **({"weight_error": weight_error, "loss_error": loss_error} if moved else {})}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import metadata

    result["meta"] = metadata()  # the command, commit, machine and versions, as every benchmark's
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, held in checks.items():
        print(f"{'ok  ' if held else 'FAIL'} {name}", flush=True)
    print(f"{len(faults)} faults, {chaos.launches} launches: {chaos_s:.0f} s against {straight_s:.0f} s without",
          flush=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
