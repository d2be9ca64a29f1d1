"""Which rank of a run has gone, and a rendezvous that survives an elastic restart.

``attempt_store``: the rendezvous store of this launch attempt. torchrun keeps one store for all
attempts of a job; a restarted group that read the keys of the attempt before it (gloo's peer
addresses) would connect to dead processes. A prefix naming the attempt keeps them apart.

``PeerWatch``: every rank's thread adds one to its counter in that store every ``beat_s`` seconds
and reads the others'. A rank whose counter stops is gone (SIGKILL, out of memory, a lost node);
a rank that ends posts how (``finished``, or its error). After a failed collective,
``lost_peers`` says which rank went and why, so the error names it. A rank that stays silent for
``silence_s`` while this one is blocked in a collective that will never return (NCCL waits for the
process group's timeout) ends this process, with the same message, before that timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import threading
import time

import torch.distributed as dist

log = logging.getLogger("megabatch")

BEAT_S = 1.0  # how often each rank adds to its counter
FAILED = "failed"  # how a rank that ended with an error begins its end note


def attempt_store(rank: int, world_size: int, timeout_s: float):
    """The env:// rendezvous store (torchrun's, or rank 0's without it) under a prefix naming this
    launch attempt (``TORCHELASTIC_RESTART_COUNT``) and its world size; and a second client of the
    same store for the heartbeats (``PeerWatch``), so that they never share a connection with the
    process groups' own use of the store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"megabatch/attempt_{attempt}/world_{world_size}"
    watch = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(prefix, store), dist.PrefixStore(prefix, watch)


def store_host() -> str:
    """Who serves the rendezvous store: torchrun's agent, or rank 0 itself (``srun`` without torchrun)."""
    return "torchrun" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"


class RankLost(RuntimeError):
    """Another rank of the run has gone (or failed); this one cannot go on."""


_COMMUNICATION = re.compile(r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed out|socket|"
                            r"store|peer", re.IGNORECASE)


def is_communication_error(error: BaseException) -> bool:
    """An error of a collective or of the store (a peer that went away), not of this rank's own work."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and bool(_COMMUNICATION.search(str(error)))


class PeerWatch:
    """Heartbeats of every rank through the rendezvous ``store`` (see the module's docstring)."""

    def __init__(self, store, rank: int, world_size: int, silence_s: float, beat_s: float = BEAT_S):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.silence_s, self.beat_s = silence_s, beat_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # its store client serves the thread and the main thread
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._thread = threading.Thread(target=self._run, name="megabatch-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        with self._lock:
            self.store.add(f"beat/{self.rank}", 1)

    def _run(self) -> None:
        failures = 0  # store errors in a row: a rank 0 that served it may just have ended as the others end
        while not self._stop.wait(self.beat_s):
            try:
                self._beat()
                silent, failures = self._silent(self.silence_s), 0
            except Exception as error:  # noqa: BLE001 - the store itself went away (its host is gone)
                failures += 1
                silent = unreachable(error) if failures >= 3 else {}
            if silent and not self._stop.is_set():
                self._abort(silent)

    def _counters(self) -> dict[int, int]:
        with self._lock:
            return {r: int(self.store.add(f"beat/{r}", 0)) for r in range(self.world_size) if r != self.rank}

    def _ended(self, rank: int) -> str | None:
        with self._lock:
            if not self.store.check([f"ended/{rank}"]):
                return None
            return self.store.get(f"ended/{rank}").decode(errors="replace")

    def _silent(self, silence_s: float) -> dict[int, str]:
        """The ranks whose counter has not moved for ``silence_s`` seconds (those that posted an end:
        only if it was a failure)."""
        now, silent = time.monotonic(), {}
        for rank, count in self._counters().items():
            before = self._seen.get(rank)
            if before is None or before[0] != count:
                self._seen[rank] = (count, now)
            elif now - before[1] >= silence_s:
                ended = self._ended(rank)
                if ended is None:
                    silent[rank] = f"no heartbeat for {now - before[1]:.0f} s (killed, out of memory, or its node lost)"
                elif ended.startswith(FAILED):
                    silent[rank] = ended
        return silent

    def lost_peers(self, wait_s: float | None = None) -> dict[int, str]:
        """After a failed collective: the ranks that failed or went silent, watched for up to
        ``wait_s`` seconds (a dead rank's counter stops; a live one's moves within a beat)."""
        wait_s = 3 * self.beat_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        try:
            while True:
                failed = {r: ended for r in range(self.world_size) if r != self.rank
                          and (ended := self._ended(r)) is not None and ended.startswith(FAILED)}
                if failed:
                    return failed
                silent = self._silent(min(wait_s, 2.5 * self.beat_s))
                if silent or time.monotonic() >= deadline:
                    return silent
                time.sleep(self.beat_s / 4)
        except Exception as error:  # noqa: BLE001 - the store itself went away (its host is gone)
            return unreachable(error)

    def end(self, how: str = "finished") -> None:
        """Stop beating; tell the others how this rank ended: ``finished``, ``stopped`` (a requested
        stop) or ``failed: <its error>``. The heartbeat thread is joined (briefly): left running into
        the interpreter's exit, its store calls can abort the process."""
        self._stop.set()
        try:
            with self._lock:
                self.store.set(f"ended/{self.rank}", how[:2000])
        except Exception:  # noqa: BLE001 - the store may be gone with its host: nothing to tell
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _abort(self, silent: dict[int, str]) -> None:
        """A rank went silent while this one may be blocked in a collective that never returns:
        say which, give the main thread a moment to fail by itself, then end the process."""
        log.error("%s; this rank (%d) stops", describe(silent), self.rank)
        if self._stop.wait(max(5.0, 5 * self.beat_s)):
            return  # the main thread ended the run meanwhile
        log.error("rank %d: still blocked in a collective; exiting", self.rank)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(1)

    def wait_for(self, key: str, owner: int) -> None:
        """Block until rank ``owner`` sets ``key`` in the store (as long as it is alive)."""
        while True:
            with self._lock:
                if self.store.check([key]):
                    return
            lost = self._silent(self.silence_s)
            if owner in lost:
                raise RankLost(describe({owner: lost[owner]}))
            time.sleep(0.2)

    def post(self, key: str, value: str = "1") -> None:
        with self._lock:
            self.store.set(key, value)


def unreachable(error: Exception) -> dict[int, str]:
    """The store is gone: with it rank 0 when rank 0 served it, else torchrun's agent (its node)."""
    why = f"the rendezvous store, which {store_host()} serves, is unreachable ({type(error).__name__}: {error})"
    return {0: why} if store_host() == "rank 0" else {-1: why}


def describe(lost: dict[int, str]) -> str:
    """``rank 1 is gone: no heartbeat for 3 s (...)`` for each lost rank (-1: the store)."""
    return "; ".join(f"rank {rank} is gone: {why}" if rank >= 0 else why for rank, why in sorted(lost.items()))
