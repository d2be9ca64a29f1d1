"""The data's process-wide settings for a run, made once before anything is built (beside
``megabatch.runtime.process.configure_backends``)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from ..runtime.process import start_worker_server
from .gpu_decode import resolve_decode
from .worker_start import resolve_worker_start


def configure_loading(data: DictConfig, device: torch.device) -> list[str]:
    """Set what loading ``data`` on ``device`` needs process-wide; idempotent. Returns one line per setting,
    for the log.

    - JPEG decoding on the GPU: this thread's work leaves the legacy default stream for a stream of
      its own, because nvJPEG's calls synchronise with the legacy stream and decoding ahead would
      otherwise wait for the step's queued kernels.
    - Loader workers started from a fork server (``data.worker_start``, ``auto`` on CUDA): the server
      started now, importing the data modules while the model is built (``data/worker_start.py``).
    """
    done = []
    if device.type == "cuda" and resolve_decode(data.decode, device) == "gpu":
        if torch.cuda.current_stream(device) == torch.cuda.default_stream(device):
            torch.cuda.set_stream(torch.cuda.Stream(device))
        done.append("the step's work on a CUDA stream of its own, beside the JPEG decoding (data.decode=gpu)")
    if resolve_worker_start(data, device.type) == "forkserver":
        start_worker_server()
        done.append("loader workers forked from a server process started now (data.worker_start=forkserver): an "
                    "epoch's loader costs this process no fork of itself")
    return done
