"""Imported only by the loader's fork server (``data/worker_start.py``), as its first preload: the
server, and every worker forked from it before that worker's own ``ignore_stop_signals``, ignore
the stop signals. A job's SIGTERM reaches every process of the job; the training process stops
the run at a step's end (``train/trainer/stops.py``), and until then its loaders must keep their
workers, whose parent is this server. This import's side effect is the module's whole purpose; no
other process imports it."""

from ..runtime.signals import ignore_stop_signals

ignore_stop_signals()
