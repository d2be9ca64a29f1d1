"""How long a stopped run takes from the signal to its exit, and whether its last.pt holds the step it stopped after.

Starts ``train.py`` as a user does (``--launcher python``, or ``torchrun --nproc_per_node=N``), waits
for ``--after-steps`` logged steps, sends SIGTERM (``--to``: ``workers``, the training processes
only; ``launcher``, torchrun alone; ``group``, every process of the job), and times the exit. Each
row: the seconds from the signal to the exit, the exit status, the step the log says it stopped
after and the one ``last.pt`` holds, and the checkpoint's size.

    python scripts/benchmarks/stop.py --launcher torchrun --ranks 2 --to workers --out stop.json -- batch=64 eval=none
    python scripts/benchmarks/stop.py --launcher python --out stop_vit_l14.json -- model=vit_l14 batch=64 eval=none
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench import write_results

ROOT = Path(__file__).resolve().parents[2]


def worker_pids(launcher_pid: int) -> list[int]:
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def stop_once(launcher: str, ranks: int, to: str, after_steps: int, overrides: list[str], workdir: Path,
              name: str) -> dict:
    run_dir = workdir / "runs" / name
    python = [sys.executable, str(ROOT / "train.py")]
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", str(ROOT / "train.py")]
    command = (python if launcher == "python" else torchrun) + [*overrides, f"name={name}", "trainer.log_every=1"]
    log = open(workdir / f"{name}.log", "w")
    job = subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps):
        if job.poll() is not None:
            raise SystemExit(f"the run ended before step {after_steps}: see {workdir / f'{name}.log'}")
        time.sleep(0.05)
    signalled = time.perf_counter()
    if to == "group":
        os.killpg(job.pid, signal.SIGTERM)
    elif to == "launcher" or launcher == "python":
        job.send_signal(signal.SIGTERM)
    else:
        for pid in worker_pids(job.pid):
            os.kill(pid, signal.SIGTERM)
    status = job.wait()
    seconds = time.perf_counter() - signalled
    log.close()
    text = (workdir / f"{name}.log").read_text()
    said = re.findall(r"stopped after step (\d+)", text)
    last = run_dir / "checkpoints" / "last.pt"
    saved = torch.load(last, map_location="cpu", weights_only=True, mmap=True)["step"] if last.exists() else None
    return {"launcher": launcher, "ranks": ranks, "signal_to": to, "signal_at_step": after_steps,
            "signal_to_exit_s": round(seconds, 2), "exit_status": status,
            "stopped_after_step": int(said[-1]) if said else None, "last_pt_step": saved,
            "last_pt_gb": round(last.stat().st_size / 1e9, 3) if last.exists() else None,
            "checkpoint_log": [line for line in text.splitlines() if "checkpoint at step" in line][-2:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=("python", "torchrun"), default="python")
    parser.add_argument("--ranks", type=int, default=1, help="torchrun --nproc_per_node")
    parser.add_argument("--to", choices=("workers", "launcher", "group"), default="workers")
    parser.add_argument("--after-steps", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/megabatch-stop")
    parser.add_argument("--out", default="stop.json")
    parser.add_argument("overrides", nargs="*", help="train.py's overrides (after --)")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"stop-{args.launcher}-{args.to}-{int(time.time())}"
    row = stop_once(args.launcher, args.ranks, args.to, args.after_steps, args.overrides, workdir, name)
    print(row, flush=True)
    write_results(args.out, [row], command=" ".join(sys.argv))


if __name__ == "__main__":
    main()
