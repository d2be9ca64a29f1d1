"""Stopping a run cleanly: SIGTERM, SIGINT, SIGUSR1 (what SLURM, Kubernetes and a Ctrl-C send) and
``trainer.time_limit`` ask the run to stop at the next step boundary.

The step in progress finishes, every rank agrees on the step to stop after (one all-reduce of a
flag per step), ``last.pt`` is written, and the run exits with ``PREEMPTED_EXIT`` (3);
``resume=latest`` continues it exactly. A second signal exits at once. Loader and re-decode worker
processes ignore these signals (``ignore_stop_signals``): the signal reaches every process of a
job, and only the main process decides (``distributed/signals.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from ..distributed.signals import STOP_SIGNALS

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
    (and why) to stop now, the same on every rank."""

    def __init__(self, time_limit_s: float | None, device: torch.device, distributed: bool):
        self.deadline = time.monotonic() + time_limit_s if time_limit_s else None
        self.device, self.distributed = device, distributed
        self.requested: str | None = None
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread (a notebook's worker thread: none)
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:  # the second one: now
            log.warning("%s again: exiting at once, without a checkpoint", name)
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.requested = name
        log.warning("%s received: finishing this step, then a checkpoint and exit (send it again to exit "
                    "at once)", name)

    def reason(self, step_s: float) -> str | None:
        """Why to stop after the step just done (a request, or the next step would overrun
        ``trainer.time_limit``), agreed across ranks; ``None`` to go on."""
        reason = self.requested
        if reason is None and self.deadline is not None and time.monotonic() + 1.5 * step_s > self.deadline:
            reason = "trainer.time_limit"
        if self.distributed:  # every rank stops after the same step
            flag = torch.tensor([0.0 if reason is None else 1.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and reason is None:  # host sync, once per step
                reason = "another rank's stop request"
        return reason

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
