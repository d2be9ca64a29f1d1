"""Reading runs back: a run's ``status.json`` and metrics, and a sweep's summary table and picture
(``summary.{csv,md,png}``), written by the ``SweepSummary`` Hydra callback when a multirun ends and
by ``scripts/report.py`` for any run directories."""

from .runs import RunRow, RunStatus, read_run
from .summary import find_runs, write_summary

__all__ = ["RunRow", "RunStatus", "read_run", "find_runs", "write_summary", "SweepSummary"]


def __getattr__(name):  # the callback imports Hydra's callback base: only when Hydra asks for it
    if name == "SweepSummary":
        from .sweep import SweepSummary

        return SweepSummary
    raise AttributeError(name)
