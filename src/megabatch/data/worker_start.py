"""How the training loader's worker processes start (``data.worker_start``).

A loader per epoch starts its workers when the previous epoch is about to end (``train/build/inputs.py``).
Forked from the training process, each worker copies that process's page tables: on a GPU rank,
with CUDA, the model and the pinned buffers mapped, forking 12 workers took 0.41-0.48 s of the main
thread once an epoch (ViT-B/32 at 32k on an H200 and on 4 H200s; docs/bench), the slowest step of
the run. ``forkserver`` forks them from a small server process instead, started once at start-up
(``train.py``'s ``configure_process``, else ``configure_loading``) with the data modules imported; the training
process only sends it each worker's pickled dataset. The samples are the same (a worker's randomness is seeded by
the loader and by the sample's position, not inherited).

- ``auto``: ``forkserver`` on CUDA ranks with loader workers, ``fork`` elsewhere (a CPU run's process
  is small, and a fork server costs a process that imports torch).
- ``fork``: as before. Datasets that cannot be pickled need it.
- ``forkserver``: anywhere (Linux).
"""

from __future__ import annotations

import multiprocessing
import pickle

from ..runtime.process import start_worker_server


def resolve_worker_start(data_cfg, device_type: str) -> str:
    """``data.worker_start`` for a run on ``device_type`` ("cuda" or "cpu"): ``fork`` or ``forkserver``."""
    start = str(getattr(data_cfg, "worker_start", "auto"))  # a DataSettings, or a config stored before the key
    if start != "auto":
        return start
    return "forkserver" if device_type == "cuda" and int(data_cfg.num_workers) > 0 else "fork"


def worker_context(start: str):
    """The multiprocessing context a DataLoader starts its workers with: ``None`` (the default, fork
    on Linux) or the fork server's."""
    if start == "fork":
        return None
    start_worker_server()  # started at start-up (train.py, configure_loading); here for a loader built without it
    return multiprocessing.get_context("forkserver")


class PickledOnce:
    """``obj`` (a callable: the tokenizer), pickled once for every worker a fork server starts. Each
    worker's start pickles its loader's dataset; an open_clip tokenizer's vocabulary takes 67 ms of
    the training process each time (2 MB), more than the fork the server saves. This wrapper pickles
    it once and hands the bytes after (a copy); a worker unpickles the object itself."""

    def __init__(self, obj):
        self.obj, self._pickled = obj, None

    def __call__(self, *args, **kwargs):
        return self.obj(*args, **kwargs)

    def __reduce__(self):
        if self._pickled is None:
            self._pickled = pickle.dumps(self.obj, protocol=pickle.HIGHEST_PROTOCOL)
        return pickle.loads, (self._pickled,)
