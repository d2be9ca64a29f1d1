"""Process-group set-up from torchrun's environment, or SLURM's under ``srun`` without torchrun
(gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .health import PeerWatch, attempt_store
from .slurm import torchrun_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: ``rank`` of ``world_size``, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    peers: PeerWatch | None = None  # every rank's heartbeat (several ranks launched here)
    control_group: object = None    # a CPU (gloo) group for host-side flags; None: the default group is one

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600) -> DistEnv:
    """Initialise the default process group when launched by torchrun (``WORLD_SIZE`` set) or by
    ``srun`` (``SLURM_PROCID``/``SLURM_NTASKS``, translated by ``slurm.torchrun_env``).

    ``timeout_s`` bounds every collective, so a stuck or dead rank fails the run instead of hanging
    it; a rank that dies is named by the others (``health.PeerWatch``), and a group restarted by
    ``torchrun --max-restarts`` rendezvous apart from the attempt before it (``health.attempt_store``).
    ``device=auto`` takes ``cuda:<local_rank>`` when CUDA is available, else the CPU; a task
    that sees one GPU (``srun --gpus-per-task=1``) takes that one.
    """
    slurm = torchrun_env(os.environ)
    if slurm:
        os.environ.update(slurm)
        log.info("SLURM task %s of %s (local %s): rendezvous at %s:%s", slurm["RANK"], slurm["WORLD_SIZE"],
                 slurm["LOCAL_RANK"], slurm["MASTER_ADDR"], slurm["MASTER_PORT"])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        index = 0 if torch.cuda.device_count() == 1 else local_rank
        torch.cuda.set_device(index)
        torch_device = torch.device("cuda", index)
    else:
        torch_device = torch.device(device)
    peers = control = None
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch_device.type == "cuda" else "gloo"
        store, watch_store = attempt_store(rank, world_size, timeout_s)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch_device if torch_device.type == "cuda" else None,
        )
        if backend != "gloo":  # host-side flags (the stop request) travel without touching the GPU
            control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # a silent rank ends this one within the collective timeout, named
        peers = PeerWatch(watch_store, rank, world_size, silence_s=max(10.0, timeout_s / 2)).start()
        log.info("rank %d/%d on %s (%s)", rank, world_size, torch_device, backend)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device, peers=peers,
                   control_group=control)
