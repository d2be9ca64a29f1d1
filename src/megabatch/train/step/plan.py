"""The batch arithmetic of a run, checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError, parse_count, parse_optional_count, parse_samples_total


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
    def from_config(cls, cfg, world_size: int, num_samples: int, steps_per_epoch: int | None = None,
                    sub_batch: int | None = None) -> BatchPlan:
        """``sub_batch``: the size ``trainer.sub_batch=auto`` chose (required with auto)."""
        global_batch = parse_count(cfg.batch, "batch")
        if global_batch % world_size:
            raise ConfigError(
                f"batch={global_batch} does not divide over {world_size} ranks; use a multiple of "
                f"{world_size} (e.g. batch={world_size * max(1, global_batch // world_size)})"
            )
        rank_batch = global_batch // world_size
        if sub_batch is None:
            sub_batch = parse_optional_count(cfg.trainer.sub_batch, "trainer.sub_batch") or rank_batch
        if rank_batch % sub_batch:
            raise ConfigError(
                f"trainer.sub_batch={sub_batch} does not divide the per-rank batch {rank_batch} "
                f"(batch={global_batch} / {world_size} ranks); pick a divisor of {rank_batch} for "
                "trainer.sub_batch, or a batch that is a multiple of world size x trainer.sub_batch"
            )
        steps_per_epoch = steps_per_epoch or num_samples // global_batch
        if steps_per_epoch == 0:
            raise ConfigError(
                f"batch={global_batch} is larger than the training set ({num_samples} samples); "
                "lower batch or add data"
            )
        total_steps = run_length(cfg.trainer, global_batch, steps_per_epoch)
        return cls(global_batch, world_size, rank_batch, sub_batch, steps_per_epoch, total_steps)


def run_length(trainer, global_batch: int, steps_per_epoch: int) -> int:
    """The run's steps from exactly one of ``trainer.max_steps``, ``trainer.epochs`` and
    ``trainer.max_samples`` (``ceil(max_samples / global_batch)``: at least that many samples seen)."""
    if trainer.max_steps is not None:
        return int(trainer.max_steps)
    if trainer.epochs is not None:
        return int(trainer.epochs) * steps_per_epoch
    return -(-parse_samples_total(trainer.max_samples, "trainer.max_samples") // global_batch)
