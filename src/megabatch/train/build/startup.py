"""Where a run's start-up goes: the seconds of each phase from the process's start to its first
finished step, in the log, the first ``metrics.jsonl`` record and ``status.json``.

    times = StartupTimes()          # at the trainer's start: the process's age is the launch phase
    with times.phase("model"):
        ...
    times.describe()                # 'launch 6.1 s, model 2.0 s, ...'
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from ...runtime.signals import process_age_s

LAUNCH = "launch"  # the interpreter, the imports and the config before the trainer starts (or, for a later
# job of a multirun, the time since the one before it ended)

_previous_run_ended: float | None = None  # time.time() when this process's previous run ended


def run_ended() -> None:
    """A run of this process has ended: the next one's start-up counts from here (a multirun's next job)."""
    global _previous_run_ended
    _previous_run_ended = time.time()


class StartupTimes:
    """Seconds per named phase, in the order each first ran (a phase run twice adds up).
    ``launch``: the process's age when this was made, or the time since this process's previous run
    ended (a multirun's later job: its own start-up, not the jobs before it)."""

    def __init__(self) -> None:
        launch = process_age_s() if _previous_run_ended is None else max(0.0, time.time() - _previous_run_ended)
        self.seconds: dict[str, float] = {LAUNCH: launch}
        self.created = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds from the start (the process's, or the previous run's end) to now."""
        return self.seconds[LAUNCH] + time.perf_counter() - self.created

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def record(self) -> dict[str, float]:
        """``{"startup/<phase>_s": seconds}`` (spaces as underscores), rounded to 10 ms."""
        return {f"startup/{name.replace(' ', '_')}_s": round(seconds, 2) for name, seconds in self.seconds.items()}

    def describe(self) -> str:
        """``'launch 6.1 s, model 2.0 s, ...'``."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
