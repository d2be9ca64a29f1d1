"""One run per run directory: a lock file with the holder's host and pid, kept fresh by a heartbeat.

A second run on the same directory (a requeued job whose first copy still runs, the same ``name``
typed twice) fails at once. A lock whose holder is gone is taken over with a warning: on this host
when its pid no longer exists, on another host when its heartbeat is older than ``stale_s`` (a
killed node cannot remove its lock, and a requeued job may start anywhere).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from ...config import ConfigError
from ...runtime.signals import process_alive

log = logging.getLogger(__name__)


class RunLock:
    """``<run_dir>/.lock``; ``acquire`` or a ``ConfigError`` naming the holder; ``release`` at the end."""

    def __init__(self, run_dir: Path, heartbeat_s: float = 30.0, stale_s: float = 300.0):
        self.path = Path(run_dir) / ".lock"
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.me = {"host": socket.gethostname(), "pid": os.getpid()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(3):  # a taken-over stale lock may be raced for by another starting run
            try:
                handle = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                self._judge_holder()
                continue
            with os.fdopen(handle, "w") as file:
                json.dump({**self.me, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, file)
            self._thread = threading.Thread(target=self._beat, name="megabatch-run-lock", daemon=True)
            self._thread.start()
            return
        raise ConfigError(f"could not take the lock {self.path}: another run keeps taking it")

    def _judge_holder(self) -> None:
        """Remove the lock if its holder is gone; else raise, naming it."""
        try:
            holder = json.loads(self.path.read_text() or "{}")
            age = time.time() - self.path.stat().st_mtime
        except (OSError, ValueError):  # removed meanwhile, or half-written: look again
            return
        host, pid = holder.get("host"), holder.get("pid")
        if host == self.me["host"]:
            gone = not isinstance(pid, int) or not process_alive(pid)
        else:  # another host's process cannot be asked: its heartbeat says whether it lives
            gone = age > self.stale_s
        if not gone:
            raise ConfigError(f"{self.path.parent} is in use by pid {pid} on {host} (lock {self.path}, "
                              f"refreshed {age:.0f} s ago): wait for that run, give this one another "
                              "name=, or remove the lock if that run is dead")
        log.warning("taking over %s from pid %s on %s, which is gone (lock last refreshed %.0f s ago)",
                    self.path, pid, host, age)
        self.path.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            try:
                if json.loads(self.path.read_text()).get("pid") == self.me["pid"]:
                    self.path.unlink()
            except (OSError, ValueError):
                pass
