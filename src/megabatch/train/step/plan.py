"""The batch arithmetic of a run, checked once at start-up."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...config import ConfigError
from ...config.run import RunSettings, TrainerSettings


@dataclass(frozen=True)
class BatchPlan:
    """``global_batch = world_size x rank_batch``; ``rank_batch = sub_batches x sub_batch``."""

    global_batch: int
    world_size: int
    rank_batch: int
    sub_batch: int
    steps_per_epoch: int
    total_steps: int

    @property
    def sub_batches(self) -> int:
        return self.rank_batch // self.sub_batch

    @classmethod
    def of(cls, settings: RunSettings, world_size: int, num_samples: int,
           steps_per_epoch: Callable[[int, int], int] | None = None, sub_batch: int | None = None) -> BatchPlan:
        """The run's plan, built once: ``settings.batch`` over ``world_size`` ranks, each rank's share in sub-batches
        of ``sub_batch`` (the size ``trainer.sub_batch=auto`` chose; else ``trainer.sub_batch``, else the whole
        share). An epoch is ``num_samples // global_batch`` steps, or what ``steps_per_epoch(global_batch,
        sub_batch)`` says the data gives every rank (a shard split's slots)."""
        global_batch = settings.batch
        rank_batch = rank_batch_of(global_batch, world_size)
        if sub_batch is None:
            configured = settings.trainer.sub_batch
            sub_batch = configured if isinstance(configured, int) else rank_batch
        if rank_batch % sub_batch:
            raise ConfigError(
                f"trainer.sub_batch={sub_batch} does not divide the per-rank batch {rank_batch} "
                f"(batch={global_batch} / {world_size} ranks); pick a divisor of {rank_batch} for "
                "trainer.sub_batch, or a batch that is a multiple of world size x trainer.sub_batch"
            )
        if num_samples // global_batch == 0:
            raise ConfigError(
                f"batch={global_batch} is larger than the training set ({num_samples} samples); "
                "lower batch or add data"
            )
        steps = num_samples // global_batch if steps_per_epoch is None else steps_per_epoch(global_batch, sub_batch)
        return cls(global_batch, world_size, rank_batch, sub_batch, steps,
                   run_length(settings.trainer, global_batch, steps))


def rank_batch_of(global_batch: int, world_size: int) -> int:
    """Each rank's share of ``global_batch`` (a ``ConfigError`` where it does not divide)."""
    if global_batch % world_size:
        raise ConfigError(
            f"batch={global_batch} does not divide over {world_size} ranks; use a multiple of "
            f"{world_size} (e.g. batch={world_size * max(1, global_batch // world_size)})"
        )
    return global_batch // world_size


def run_length(trainer: TrainerSettings, global_batch: int, steps_per_epoch: int) -> int:
    """The run's steps from exactly one of ``trainer.max_steps``, ``trainer.epochs`` and
    ``trainer.max_samples`` (``ceil(max_samples / global_batch)``: at least that many samples seen)."""
    if trainer.max_steps is not None:
        return trainer.max_steps
    if trainer.epochs is not None:
        return trainer.epochs * steps_per_epoch
    return -(-trainer.max_samples // global_batch)
