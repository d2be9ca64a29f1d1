"""The batch arithmetic of a run, checked once at start-up."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...config import ConfigError
from ...config.run import RunSettings, TrainerSettings


@dataclass(frozen=True)
class BatchPlan:
    """``global_batch = world_size x rank_batch``; ``rank_batch = sub_batches x sub_batch``. ``token_budget``
    (``trainer.sub_batch_tokens``, a NaFlex tower's): the image patches one sub-batch may hold; ``sub_batch`` is then
    what fits at the longest sequence length, and a step of shorter images joins the loader's sub-batches into
    fewer, larger ones (``joined``)."""

    global_batch: int
    world_size: int
    rank_batch: int
    sub_batch: int
    steps_per_epoch: int
    total_steps: int
    token_budget: int | None = None

    @property
    def sub_batches(self) -> int:
        return self.rank_batch // self.sub_batch

    def joined(self, length: int) -> int:
        """How many of the loader's sub-batches one sub-batch of images ``length`` patches long joins: the most that
        divides the step's ``sub_batches`` and keeps ``token_budget`` (1 without one)."""
        return joined_sub_batches(self.sub_batches, self.sub_batch, length, self.token_budget)

    def rows_at(self, lengths) -> dict[int, int]:
        """Each of ``lengths``' rows per sub-batch (``sub_batch`` times ``joined``)."""
        return {length: self.sub_batch * self.joined(length) for length in lengths}

    @classmethod
    def of(cls, settings: RunSettings, world_size: int, num_samples: int,
           steps_per_epoch: Callable[[int, int], int] | None = None, sub_batch: int | None = None,
           longest: int | None = None, token_budget: int | None = None) -> BatchPlan:
        """The run's plan, built once: ``settings.batch`` over ``world_size`` ranks, each rank's share in sub-batches
        of ``sub_batch`` (the size ``trainer.sub_batch=auto`` chose; else ``trainer.sub_batch``, else the largest
        divisor of the share whose images of ``longest`` patches (a NaFlex tower's longest sequence length) keep
        ``trainer.sub_batch_tokens``, else the whole share). ``token_budget``: the one ``trainer.sub_batch=auto``
        measured for a NaFlex tower (in place of ``trainer.sub_batch_tokens``). An epoch is ``num_samples //
        global_batch`` steps, or what ``steps_per_epoch(global_batch, sub_batch)`` says the data gives every rank (a
        shard split's slots)."""
        global_batch = settings.batch
        rank_batch = rank_batch_of(global_batch, world_size)
        tokens = settings.trainer.sub_batch_tokens if token_budget is None else token_budget
        if tokens is not None:
            sub_batch = sub_batch_for_tokens(tokens, longest, rank_batch)
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
                   run_length(settings.trainer, global_batch, steps), tokens)


def joined_sub_batches(sub_batches: int, sub_batch: int, length: int, token_budget: int | None) -> int:
    """``BatchPlan.joined``: of a step's ``sub_batches`` sub-batches of ``sub_batch`` images, how many one sub-batch of
    images ``length`` patches long joins under ``token_budget`` (the most that divides ``sub_batches``; 1 without a
    budget). ``trainer.sub_batch=auto`` plans with it before the plan exists (``train/build/memory_plan.py``)."""
    if token_budget is None:
        return 1
    return max((d for d in range(1, sub_batches + 1)
                if sub_batches % d == 0 and d * sub_batch * length <= token_budget), default=1)


def sub_batch_for_tokens(tokens: int, longest: int | None, rank_batch: int) -> int:
    """``trainer.sub_batch_tokens``' sub-batch at the longest sequence length ``longest``: the largest divisor of
    ``rank_batch`` whose patches keep the budget; a ``ConfigError`` naming the keys where it cannot (beside
    ``trainer.sub_batch``, the config's check refuses it)."""
    if longest is None:
        raise ConfigError(f"trainer.sub_batch_tokens={tokens} cuts a NaFlex tower's sub-batches by their image "
                          "patches (model.image.naflex=true); a fixed-size tower's are cut by trainer.sub_batch: "
                          "set that, and trainer.sub_batch_tokens=null")
    if tokens < longest:
        raise ConfigError(f"trainer.sub_batch_tokens={tokens} is less than one image at the longest sequence length "
                          f"({longest} patches, data.naflex.seq_lens): raise trainer.sub_batch_tokens to at least "
                          f"{longest}, or drop the longer lengths")
    return max(d for d in range(1, min(rank_batch, tokens // longest) + 1) if rank_batch % d == 0)


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
