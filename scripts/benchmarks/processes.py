"""The process tree under a launch, for the harnesses that stop one (``multi_gpu.py``, ``chaos.py``).

torchrun's workers are not in its process group (the elastic agent starts them in sessions of their own), so a
signal to the launcher's group misses them: a run stopped that way leaves its workers holding the GPUs, and the
next run then runs out of memory beside them. The tree is read from ``/proc`` (every thread's children, Linux)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    """``pid``'s child processes, whichever of its threads started them (none once it has exited)."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def signal_tree(pid: int, sig: int, known: set[int] | None = None) -> set[int]:
    """``sig`` to ``pid`` and every process under it, and to ``known`` (a tree read earlier, whose members may have
    lost their parent since: orphans are no longer under ``pid``); returns every process signalled. The whole tree
    is read before the first signal: a launcher that exits at once leaves its children to init, out of reach."""
    tree = {pid, *descendants(pid), *(known or ())}
    for member in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, sig)
    return tree


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: set[int], timeout_s: float) -> bool:
    """Whether every one of ``pids`` has exited within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
