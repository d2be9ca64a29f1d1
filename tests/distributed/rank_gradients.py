"""One rank of a 2-rank gloo step, however it was started (torchrun or srun's variables only):
``python -m tests.distributed.rank_gradients <out_dir>`` writes ``rank<N>.pt`` with its gradients
and where it stood."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megabatch.distributed import init_distributed
from tests.helpers import gradients

if __name__ == "__main__":
    torch.set_num_threads(1)
    env = init_distributed("cpu", timeout_s=120)
    assert dist.is_initialized() and dist.get_world_size() == env.world_size
    grads = gradients(env.rank, env.world_size, ["loss=vanilla"])
    torch.save({"rank": env.rank, "world": env.world_size, "local": env.local_rank, "grads": grads},
               Path(sys.argv[1]) / f"rank{env.rank}.pt")
    if env.peers is not None:  # the heartbeat thread ends before the process does
        env.peers.end()
    dist.destroy_process_group()
