"""Process-group set-up from torchrun's environment (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: ``rank`` of ``world_size``, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600) -> DistEnv:
    """Initialise the default process group when launched by torchrun (``WORLD_SIZE`` set).

    ``timeout_s`` bounds every collective, so a stuck or dead rank fails the run instead of hanging
    it. ``device=auto`` takes ``cuda:<local_rank>`` when CUDA is available, else the CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device(device)
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch_device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch_device if torch_device.type == "cuda" else None,
        )
        log.info("rank %d/%d on %s (%s)", rank, world_size, torch_device, backend)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device)
