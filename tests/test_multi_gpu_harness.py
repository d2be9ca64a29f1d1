"""scripts/benchmarks/multi_gpu.py stopped from outside (an outer ``timeout``, a device's command limit): the
run in progress is stopped whole and what it logged is written, where it was lost with the harness before.
Each case runs in a process of its own, so that no signal reaches pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .helpers import ROOT

HARNESS = ROOT / "scripts" / "benchmarks" / "multi_gpu.py"

# a run that never ends by itself: a child and a grandchild (as torchrun and its workers), their pids written
SLEEPER = ("import os, subprocess, sys, time; "
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
           "open(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}'); time.sleep(120)")

PRELUDE = """
import importlib.util, json, os, signal, sys, threading
spec = importlib.util.spec_from_file_location("multi_gpu", {harness!r})
harness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness)
def sleeper():
    return [sys.executable, "-c", {sleeper!r}, {pids!r}]
"""
TERM = """
def term_once_written():  # SIGTERM to this process once the run has started its grandchild
    import time
    while not os.path.exists({pids!r}) or len(open({pids!r}).read().split()) < 2:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=term_once_written, daemon=True).start()
"""


def run_case(tmp_path, body: str, term: bool = True) -> tuple[subprocess.CompletedProcess, list[int]]:
    """``body`` after the harness is loaded; ``term``: with SIGTERM sent to it once the run has started."""
    pids = tmp_path / "pids"
    script = (PRELUDE + TERM * term).format(harness=str(HARNESS), sleeper=SLEEPER, pids=str(pids)) + \
        textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HARNESS.parent)])})
    return done, [int(p) for p in pids.read_text().split()]


def load_harness():
    """scripts/benchmarks/multi_gpu.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("multi_gpu", HARNESS)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not yet reaped by its parent) counts as gone
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] == "Z"


def test_sigterm_stops_the_run_in_progress_and_its_whole_process_group(tmp_path):
    done, pids = run_case(tmp_path, """
        harness.stop_on_sigterm()
        code, out = harness.run_group(sleeper(), timeout_s=100)
        print(json.dumps({"code": code, "stopped": harness.STOPPED.is_set()}))
    """)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": "stopped", "stopped": True}
    assert all(gone(pid) for pid in pids)  # torchrun's workers too: they would hold the GPUs


def test_a_timeout_stops_the_workers_a_launcher_started_in_sessions_of_their_own(tmp_path):
    """torchrun starts its workers in sessions of their own: the launcher's process group does not hold them, and
    a timeout that signalled the group alone left them holding the GPU (the next run then ran out of memory)."""
    done, pids = run_case(tmp_path, """
        import subprocess
        def sleeper():
            return [sys.executable, "-c", {session_sleeper!r}, {pids!r}]
        code, out = harness.run_group(sleeper(), timeout_s=3)
        print(json.dumps({{"code": code}}))
    """.format(session_sleeper=SLEEPER.replace("subprocess.Popen([", "subprocess.Popen(start_new_session=True, args=["),
               pids=str(tmp_path / "pids")), term=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": "timeout"}
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


def test_a_stopped_harness_writes_the_stopped_runs_steps_and_starts_no_other(tmp_path):
    out = tmp_path / "runs.json"
    done, pids = run_case(tmp_path, f"""
        started = []
        def run_ours(gpus, batch, urls, steps, overrides, workdir, warmup, timeout_s, cold=False):
            started.append(gpus)
            code, _ = harness.run_group(sleeper(), timeout_s)
            # the steps the stopped run had logged (metrics.jsonl), as run_ours reads them
            return {{"system": "megabatch", "gpus": gpus, "batch": batch, "returncode": code,
                     "steps": [{{"step": 1, "samples_per_s": 10.0}}], "samples_per_s": {{"median": 10.0}}}}
        harness.run_ours = run_ours
        harness.dataset = lambda *args, **kwargs: "shards"
        sys.argv = ["multi_gpu.py", "--gpus", "1,2", "--batch", "1k", "--workdir", {str(tmp_path)!r},
                    "--out", {str(out)!r}]
        try:
            harness.main()
        finally:
            print(json.dumps(started))
    """)
    assert done.returncode == 128 + 15, done.stderr  # as a process stopped by SIGTERM
    assert "stopped by SIGTERM" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [1]  # the 2-GPU run never started
    rows = json.loads(out.read_text())["results"]
    assert [(row["gpus"], row["returncode"], len(row["steps"])) for row in rows] == [(1, "stopped", 1)]
    assert all(gone(pid) for pid in pids)


def test_a_failed_runs_error_lines_name_its_error_where_its_tail_does_not():
    """A run that ran out of memory and then printed 4,000 characters of torch.compile's statistics (OpenCLIP at
    128k on 2 x H200): the error lines keep the out-of-memory, the statistics are left out."""
    harness = load_harness()
    oom = "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 GiB."
    stats = "\n".join(f"[rank0]:I1128 torch/_subclasses/fake_tensor.py:3437]   cache_hits: {i}" for i in range(200))
    out = "step 0\n" + oom + "\n" + stats + "\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    assert oom not in out[-4000:]
    lines = harness.error_lines(out)
    assert lines[0] == oom and lines[-1].startswith("torch.distributed.elastic") and len(lines) == 2


def test_the_epochs_counts_are_given_as_asked_and_the_trainer_reads_each_kind(tmp_path):
    """``--counts``: sizes.json, img2dataset's per-shard _stats.json, or nothing (the trainer scans the tars); the
    counts the trainer reads are the shards' own in each case."""
    from megabatch.data.urls import expand_urls, shard_sizes

    harness = load_harness()
    got = {}
    for counts in harness.COUNTS:
        pattern = harness.dataset(12, 32, 30, tmp_path / counts, counts=counts)
        listed = Path(pattern).parent
        assert (listed / "sizes.json").exists() == (counts == "sizes")
        assert len(list(listed.glob("*_stats.json"))) == (3 if counts == "stats" else 0)
        scanned = []
        got[counts] = shard_sizes(expand_urls(pattern, "data.train.urls"), "data.train.urls", tmp_path / "cache",
                                  show_progress=False, scan=lambda path, _seen=scanned: _seen.append(path) or 12)
        assert bool(scanned) == (counts == "none")
    assert got["sizes"] == got["stats"] == [12, 12, 12]


def test_a_cold_run_gets_empty_caches_of_its_own(tmp_path, monkeypatch):
    """``--cold``: each run its own new $MEGABATCH_CACHE, inductor cache and Triton home, none inherited."""
    harness = load_harness()
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/warm")
    first, second = harness.cold_env(tmp_path), harness.cold_env(tmp_path)
    assert "TRITON_CACHE_DIR" not in first
    for key in ("MEGABATCH_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_HOME"):
        assert first[key] != second[key] and not Path(first[key]).exists()
