"""Test helpers: spawn N gloo ranks on the CPU, relative errors."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, tmp_path: Path) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; return their results.

    ``fn`` must be importable (module level) and return something ``torch.save`` can write.
    """
    out_dir = tmp_path / f"ranks{world}"
    out_dir.mkdir(exist_ok=True)
    mp.start_processes(
        _worker, args=(world, free_port(), fn, args, str(out_dir)), nprocs=world,
        start_method="spawn", join=True,
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ``|a - e| / |e|`` (in float64)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))
