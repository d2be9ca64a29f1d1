"""The chaos harness at CI's size (``scripts/benchmarks/chaos.py``): a 2-rank torchrun run under a seeded schedule of
faults (a training process killed and restarted by torchrun, the newest checkpoint cut after the whole job was
killed, a scheduler's SIGTERM and the same command again) ends with bitwise the weights and optimizer state of the run
without them, every step logged once, no process, lock or shared memory left, each fault's steps redone within its
checkpoint interval; and so does a run under FSDP, its sharded checkpoints written in the background by DCP, killed
in the middle of writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..helpers import ROOT


@pytest.mark.parametrize("seed, kinds, extra", [
    (5, "kill-worker,requeue,kill-in-write,corrupt-newest", []),
    (2, "kill-in-write,lost-node,corrupt-newest", ["--set", "batch=64", "trainer.parallel=fsdp"]),  # DCP, async
])
def test_a_run_under_three_faults_ends_as_the_run_without_them(tmp_path, seed, kinds, extra):
    out = tmp_path / "chaos.json"
    command = [sys.executable, str(ROOT / "scripts" / "benchmarks" / "chaos.py"), "--ranks", "2", "--steps", "16",
               "--faults", "3", "--seed", str(seed), "--kinds", kinds, "--workdir", str(tmp_path / "work"),
               "--out", str(out), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert all(result["checks"].values()), result["checks"]
    struck = [fault for fault in result["faults"] if "redone" in fault]
    assert len(struck) >= 2 and result["launches"] >= 2, result["faults"]  # faults did strike, and relaunches ran
