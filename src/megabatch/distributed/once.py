"""Work done once for every rank: rank 0 computes, the others receive the result."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from ..config import ConfigError

T = TypeVar("T")


def on_rank_zero(compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0 of the default process group, its (picklable) result given to every
    rank; without a group, simply ``compute()``. An error on rank 0 reaches every rank (a
    ``ConfigError`` as itself, anything else as a ``RuntimeError`` naming it), so no rank waits for a
    result that never comes."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    payload: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            payload = [("ok", compute())]
        except Exception as error:  # every rank must hear of it; rank 0 re-raises its own below
            failure = error
            kind = "config" if isinstance(error, ConfigError) else "error"
            payload = [(kind, f"{error}" if kind == "config" else f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    kind, value = payload[0]
    if kind == "config":
        raise ConfigError(value)
    if kind == "error":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value
