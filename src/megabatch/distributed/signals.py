"""The signals that ask a run to stop (what SLURM, Kubernetes and Ctrl-C send). A job's signal
reaches every one of its processes; worker processes (DataLoader workers, the offload re-decode
pool) ignore these, and the main process stops the run cleanly (``train/preemption.py``)."""

from __future__ import annotations

import signal

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name))


def ignore_stop_signals(*_, keep: tuple = ()) -> None:
    """A DataLoader ``worker_init_fn`` / a pool ``initializer``: leave stopping to the main process.
    ``keep``: signals whose handler the caller has set already (not ignored)."""
    for signum in STOP_SIGNALS:
        if signum not in keep:
            signal.signal(signum, signal.SIG_IGN)
