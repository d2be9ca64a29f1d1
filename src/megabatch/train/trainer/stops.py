"""Stopping a run cleanly: SIGTERM, SIGINT, SIGUSR1 (what SLURM, Kubernetes and a Ctrl-C send) and
``trainer.time_limit`` ask the run to stop at a step boundary.

Every rank agrees on the step to stop after, ``last.pt`` is written, no rank exits before it is on
disk, and the run exits with ``PREEMPTED_EXIT`` (3); ``resume=latest`` continues it exactly.

On several ranks the stop flag travels in an all-reduce on a CPU group that is started after one
step and read after the next (no host sync per step): a request is acted on after the step that
follows the one it arrived in, on every rank alike. The signal often reaches a process twice (a
job's signal reaches every process, and torchrun and ``srun`` forward the one they got): the second
one is taken as the same request and does not abort the checkpoint; a third exits at once, without
it. Loader and re-decode worker processes ignore these signals (``ignore_stop_signals``): only the
main process decides (``runtime/signals.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from ...runtime.signals import STOP_SIGNALS

log = logging.getLogger("megabatch")

PREEMPTED_EXIT = 3  # train.py's exit status after a clean stop (last.pt written; resume=latest continues)


class Preempted(Exception):
    """The run stopped early on request, after writing ``last.pt`` at ``step``."""

    def __init__(self, reason: str, step: int, checkpoint):
        super().__init__(f"stopped after step {step} ({reason}); checkpoint {checkpoint}: continue with "
                         f"resume=latest and the same name")
        self.reason, self.step = reason, step


class StopRequests:
    """Signal handlers and a wall-clock limit; ``reason(step_s)`` at each step boundary says whether
    (and why) to stop now, the same on every rank.

    ``group``: the CPU process group the flag is all-reduced in (``None``: the default one, which
    must then be gloo); ``distributed=False``: one process, nothing to agree on."""

    def __init__(self, time_limit_s: float | None, distributed: bool, group=None):
        self.deadline = time.monotonic() + time_limit_s if time_limit_s else None
        self.distributed, self.group = distributed, group
        self.requested: str | None = None
        self.signals = 0
        self._previous: dict = {}
        self._pending = None  # (the all-reduce in flight, its flag, the reason this rank sent with it)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread (a notebook's worker thread: none)
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.signals += 1
        if self.signals == 1:
            self.requested = name
            log.warning("%s received: finishing this step, then a checkpoint and exit (a third signal exits at "
                        "once, without the checkpoint)", name)
        elif self.signals == 2:  # torchrun or srun forwarding the job's signal, or a second Ctrl-C
            log.warning("%s again: still stopping with a checkpoint (one more signal exits at once, without it)",
                        name)
        else:
            log.warning("%s a third time: exiting at once, without a checkpoint", name)
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)

    def reason(self, step_s: float) -> str | None:
        """Why to stop after the step just done (a request, or the next steps would overrun
        ``trainer.time_limit``), agreed across ranks; ``None`` to go on."""
        # this rank's reason: acted on after this step alone, or with several ranks after the next (agreed then)
        local = self.requested
        if local is None and self.deadline is not None and \
                time.monotonic() + ((2 if self.distributed else 1) + 0.5) * step_s > self.deadline:
            local = "trainer.time_limit"
        if not self.distributed:
            return local
        # the flag sent after the previous step is read now (its all-reduce is long done: no wait
        # in practice), and this step's is sent; every rank reads the same value at the same step
        agreed = None
        if self._pending is not None:
            work, flag, sent = self._pending
            work.wait()
            if flag.numpy()[0]:  # a CPU tensor: no device to wait for
                agreed = sent or "another rank's stop request"
        flag = torch.tensor([0.0 if local is None else 1.0])
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag, local)
        return agreed

    def drain(self) -> None:
        """Wait for the flag's all-reduce still in flight (every rank sent it) at the loop's end."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def restore(self) -> None:
        """Put the previous signal handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
