"""The Hydra callback that summarises a multirun (``configs/train.yaml``: ``hydra.callbacks``).

After each job it rewrites ``runs/<sweep>/summary.{csv,md,png}`` (so a sweep in progress, or one
that was killed, has a summary of what ran), recording a job that failed before its run could
write ``status.json`` (a config error, say) as failed with its error. When the multirun ends it
prints the table, also when a job failed (Hydra then ends the sweep with that job's error, after
every job has run).
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from .runs import failure, read_status, write_status
from .summary import write_summary

log = logging.getLogger("megabatch")


class SweepSummary(Callback):
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.sweep_dir: Path | None = None
        self.printed = False

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        if not self.enabled:
            return
        self.sweep_dir = Path(config.hydra.sweep.dir)
        # a failed job makes Hydra raise once every job has run, before on_multirun_end: print then
        atexit.register(self._print_once)

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if not self.enabled or config.hydra.mode != RunMode.MULTIRUN:  # a single run: nothing to put side by side
            return
        sweep_dir = Path(config.hydra.sweep.dir)  # from the job's config: a launcher may run it in another process
        if job_return.status == JobStatus.FAILED:
            run_dir = Path(config.run_dir or job_return.hydra_cfg.hydra.runtime.output_dir)
            status = read_status(run_dir)
            if status.get("status") in (None, "running"):  # it failed before (or without) saying so
                write_status(run_dir, {**status, "status": "failed", "error": failure(job_return._return_value)})
        try:
            write_summary([sweep_dir], sweep_dir)
        except Exception as error:  # a summary must never cost the sweep its next job
            log.warning("could not write the sweep summary in %s: %s", sweep_dir, error)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        self._print_once()

    def _print_once(self) -> None:
        if self.printed or self.sweep_dir is None:
            return
        self.printed = True
        try:
            text = write_summary([self.sweep_dir], self.sweep_dir)
        except Exception as error:
            log.warning("could not write the sweep summary in %s: %s", self.sweep_dir, error)
            return
        print(f"\nsweep summary ({self.sweep_dir}/summary.md, summary.csv, summary.png):\n{text}", flush=True)
