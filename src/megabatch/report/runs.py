"""What a run directory says about its run: ``status.json`` (written by the run), ``metrics.jsonl``,
its Hydra overrides and config, its checkpoints. ``read_run`` turns one directory into one row of a
sweep's summary; it works on finished, failed and running runs alike (a line cut short is skipped).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint.files import run_checkpoints
from ..config import ConfigError, parse_count

STATUS_FILE = "status.json"
# A run's status: running; completed; stopped (before its last step, by a signal, trainer.time_limit or
# trainer.stop_at_step: resume=latest continues it); failed (an error); interrupted (it said "running"
# but its lock is no longer refreshed: killed without a word, by SIGKILL or a lost node).


class RunStatus:
    """``<run_dir>/status.json``: written at the start of an invocation ("running") and at its end.

    Wall time adds up over invocations (a resumed run continues the clock of the one before).
    Only rank 0 writes (``enabled``)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path = Path(run_dir) / STATUS_FILE
        self.enabled = enabled
        self.started = time.time()
        previous = read_status(run_dir)
        self.earlier_wall_s = float(previous.get("wall_s") or 0.0) if previous.get("status") != "running" else 0.0
        self.notes: dict[str, Any] = {}  # kept in every later write (note)

    def start(self) -> None:
        self._write(status="running", error=None)

    def end(self, status: str, error: str | None = None, result: float | None = None) -> None:
        self._write(status=status, error=error, result=result, ended=round(time.time(), 3))

    def note(self, **fields: Any) -> None:
        """Add ``fields`` to the status, in this write and every later one of this invocation."""
        self.notes.update(fields)
        self._write(status="running", error=None)

    def fail(self, error: BaseException) -> None:
        self.end("failed", error=failure(error))

    def _write(self, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"started": round(self.started, 3), "host": socket.gethostname(), "pid": os.getpid(),
                  "wall_s": round(self.earlier_wall_s + time.time() - self.started, 3), **self.notes, **fields}
        write_status(self.path.parent, record)


def failure(error: BaseException) -> str:
    """How ``status.json`` (and so a sweep's summary) names an error. An error a loader worker raised comes
    wrapped by torch ("Caught RuntimeError in DataLoader worker process 0. Original Traceback ..."): its
    own last line, the worker's error, is named (with the worker)."""
    message = str(error)
    if message.startswith("Caught ") and "Original Traceback" in message:
        lines = [line for line in message.splitlines() if line.strip()]
        where = lines[0].removeprefix("Caught ").rstrip(".")
        return f"{lines[-1].strip()} ({where.split(' in ', 1)[-1]})"
    return f"{type(error).__name__}: {message}"


def write_status(run_dir: Path, record: dict) -> None:
    """Replace ``status.json`` whole (a reader never sees half a file)."""
    path = Path(run_dir) / STATUS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, allow_nan=False, default=str) + "\n")
    tmp.replace(path)


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``metrics.jsonl``; a line that does not parse (a run writing it now, or killed
    while writing) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


def is_run_dir(path: Path) -> bool:
    """A directory that a training run wrote (or a sweep job that failed before it could)."""
    return any((Path(path) / name).exists() for name in ("metrics.jsonl", STATUS_FILE, ".hydra/overrides.yaml"))


@dataclass
class RunRow:
    """One run of a sweep, as the summary shows it."""

    path: Path
    overrides: list[str]
    status: str
    steps: int = 0
    samples_seen: int = 0
    last_loss: float | None = None
    best_loss: float | None = None
    evals: dict[str, float] = field(default_factory=dict)       # eval/<set>/<metric> at the last evaluation
    best_evals: dict[str, float] = field(default_factory=dict)  # the best value of each over the run
    samples_per_s: float | None = None   # median over the logged intervals
    mfu: float | None = None             # median, on GPUs with a known peak
    peak_gpu_gb: float | None = None
    peak_host_gb: float | None = None
    wall_s: float | None = None
    first_step_s: float | None = None    # from the process's start to its first finished step (the last invocation)
    checkpoint: str | None = None
    error: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, loss) of each logged step

    @property
    def name(self) -> str:
        return self.path.name


def read_run(run_dir: Path) -> RunRow:
    run_dir = Path(run_dir)
    status = read_status(run_dir)
    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("loss") is not None or "samples_seen" in r]
    batch = _configured_batch(run_dir)
    row = RunRow(path=run_dir, overrides=_overrides(run_dir), status=_status(run_dir, status),
                 wall_s=status.get("wall_s"), error=status.get("error"), checkpoint=_last_checkpoint(run_dir),
                 first_step_s=status.get("time_to_first_step_s"))
    if steps:
        last = steps[-1]
        row.steps = int(last["step"])
        row.samples_seen = int(last.get("samples_seen") or row.steps * (batch or 0))
        losses = [r["loss"] for r in steps if _finite(r.get("loss"))]
        row.last_loss = losses[-1] if losses else None
        row.best_loss = min(losses) if losses else None
        row.curve = [(int(r.get("samples_seen") or r["step"] * (batch or 0)), r["loss"])
                     for r in steps if _finite(r.get("loss"))]
        row.samples_per_s = _median(r.get("samples_per_s") for r in steps)
        row.mfu = _median(r.get("mfu") for r in steps)
        row.peak_gpu_gb = _max(r.get("peak_gpu_gb") for r in steps)
        row.peak_host_gb = _max(r.get("peak_host_gb") for r in steps)
    for record in records:
        for key, value in record.items():
            if key.startswith("eval/") and _finite(value) and not key.endswith("/samples"):
                row.evals[key] = value
                row.best_evals[key] = max(value, row.best_evals.get(key, value))
    if row.status == "running" and "started" in status:  # its clock runs on
        row.wall_s = float(status.get("wall_s") or 0.0) + time.time() - status["started"]
    if row.wall_s is None and len(records) > 1:  # no status file: the span of the logged records
        row.wall_s = records[-1]["time"] - records[0]["time"]
    return row


def _status(run_dir: Path, status: dict) -> str:
    state = status.get("status")
    if state == "running" or (state is None and (run_dir / ".lock").exists()):
        # a run killed without a word leaves "running" behind: believe it while its lock is refreshed
        lock = run_dir / ".lock"
        fresh = lock.exists() and time.time() - lock.stat().st_mtime < 300  # RunLock refreshes every 30 s
        return "running" if fresh else "interrupted"
    return state or "interrupted"


def _overrides(run_dir: Path) -> list[str]:
    try:
        return [str(o) for o in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []]
    except (OSError, yaml.YAMLError):
        return []


def _configured_batch(run_dir: Path) -> int | None:
    try:
        config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
        return parse_count(config["batch"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ConfigError):
        return None


def _last_checkpoint(run_dir: Path) -> str | None:
    newest_first = run_checkpoints(run_dir / "checkpoints")
    return str(newest_first[0]) if newest_first else None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _median(values) -> float | None:
    kept = [v for v in values if _finite(v)]
    return statistics.median(kept) if kept else None


def _max(values) -> float | None:
    kept = [v for v in values if _finite(v)]
    return max(kept) if kept else None
