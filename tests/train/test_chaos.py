"""The chaos harness at CI's size (``scripts/benchmarks/chaos.py``): a 2-rank torchrun run under a seeded schedule of
faults (a training process killed and restarted by torchrun, the newest checkpoint cut after the whole job was
killed, a scheduler's SIGTERM and the same command again) ends with bitwise the weights and optimizer state of the run
without them, every step logged once, no process, lock or shared memory left, each fault's steps redone within its
checkpoint interval. The run is under FSDP, its sharded checkpoints written in the background by DCP, and every kind
strikes once: also the whole job killed in the middle of a write, and a lost node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..helpers import ROOT

# in this order, seed 9 draws each kind once (the order the faults strike is in the test's docstring)
KINDS = ["kill-worker", "requeue", "kill-in-write", "lost-node", "corrupt-newest"]


def test_a_run_under_every_kind_of_fault_ends_as_the_run_without_them(tmp_path):
    """Seed 9's schedule strikes once with each kind, in this order: a requeue, a killed training process, a kill
    in the middle of a checkpoint write, the newest checkpoint cut, a lost node (~150 s on 2 cores)."""
    out = tmp_path / "chaos.json"
    command = [sys.executable, str(ROOT / "scripts" / "benchmarks" / "chaos.py"), "--ranks", "2", "--steps", "16",
               "--faults", "5", "--seed", "9", "--kinds", ",".join(KINDS), "--workdir", str(tmp_path / "work"),
               "--out", str(out), "--set", "batch=64", "trainer.parallel=fsdp"]  # DCP's background writes
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert all(result["checks"].values()), result["checks"]
    struck = [fault for fault in result["faults"] if "redone" in fault]
    # every kind did strike, and relaunches ran
    assert sorted(fault["kind"] for fault in struck) == sorted(KINDS) and result["launches"] >= 4, result["faults"]
