"""This host's processes: the signals that ask a run to stop (what SLURM, Kubernetes and Ctrl-C send)
and whether a process id is alive. A job's signal reaches every one of its processes; worker
processes (DataLoader workers, the offload re-decode pool) ignore the stop signals, and the main
process stops the run cleanly (``train/trainer/stops.py``)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("megabatch")

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name))


def ignore_stop_signals(*_, keep: tuple = ()) -> None:
    """A DataLoader ``worker_init_fn`` / a pool ``initializer``: leave stopping to the main process.
    ``keep``: signals whose handler the caller has set already (not ignored). Unblocks them after
    (``stop_signals_blocked``: a stop signal that arrived in between is then ignored)."""
    for signum in STOP_SIGNALS:
        if signum not in keep:
            signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold the stop signals back from this thread while it forks workers: a child starts with them
    blocked, so one that arrives before its ``ignore_stop_signals`` waits, and is then ignored,
    instead of running the parent's handler (or the default one, which ends the worker). This
    thread receives what arrived in between once the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)  # signal 0: existence check only (PermissionError: someone else's process)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


_IMPORTED = time.time()


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in ``/proc``; elsewhere since this
    module was imported, which the entry points do first)."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started)  # both since boot
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def end_children(timeout_s: float = 5.0) -> list[str]:
    """End this process's worker processes (loader workers, the offload's re-decode pool) within about
    ``timeout_s``: those already asked to stop are joined until the deadline, the rest are killed
    (SIGKILL: they ignore the stop signals, so the SIGTERM that ``multiprocessing`` sends at exit would
    leave its ``join`` waiting forever, a failed run that never exits). Returns the names of the killed."""
    children = multiprocessing.active_children()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    killed = []
    for child in children:
        if child.is_alive():
            killed.append(child.name)
            child.kill()
            child.join(1.0)
    if killed:
        log.warning("%d worker process(es) still running %.0f s after the run ended: killed (%s)", len(killed),
                    timeout_s, ", ".join(killed[:4]) + (" ..." if len(killed) > 4 else ""))
    return killed


def _kill_daemon_children() -> None:
    """At exit, before ``multiprocessing``'s own exit handler: daemon children still running are killed
    (that handler terminates them with SIGTERM, which our workers ignore, then joins them: a hang)."""
    for child in multiprocessing.active_children():
        if child.daemon and child.is_alive():
            child.kill()
            child.join(1.0)


_EXIT_HANDLER = []


def kill_workers_at_exit() -> None:
    """Register ``_kill_daemon_children`` to run at exit (once; registered after ``multiprocessing``'s own
    handler, so it runs first)."""
    if not _EXIT_HANDLER:
        import multiprocessing.util  # noqa: F401  its exit handler registered first: ours runs before it

        atexit.register(_kill_daemon_children)
        _EXIT_HANDLER.append(True)
