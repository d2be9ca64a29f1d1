"""Learning-rate schedules as multipliers of the peak lr; warmup in steps or in samples."""

from __future__ import annotations

import math

from ..config import ConfigError, parse_optional_count


def _warmup_steps(warmup_steps, warmup_samples, global_batch: int) -> int:
    if warmup_steps is not None and warmup_samples is not None:
        raise ConfigError("set sched.warmup_steps or sched.warmup_samples, not both")
    samples = parse_optional_count(warmup_samples, "sched.warmup_samples")
    if samples is not None:
        return math.ceil(samples / global_batch)
    return int(warmup_steps or 0)


class ConstantSchedule:
    """Linear warmup, then constant."""

    def __init__(self, total_steps: int, global_batch: int, warmup_steps=None, warmup_samples=None):
        self.total_steps = total_steps
        self.warmup = _warmup_steps(warmup_steps, warmup_samples, global_batch)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return 1.0


class CosineSchedule(ConstantSchedule):
    """Linear warmup, then cosine decay to ``min_lr_ratio`` at ``total_steps`` (or at
    ``decay_samples`` / ``decay_steps`` when given)."""

    def __init__(
        self,
        total_steps: int,
        global_batch: int,
        warmup_steps=None,
        warmup_samples=None,
        decay_steps=None,
        decay_samples=None,
        min_lr_ratio: float = 0.0,
    ):
        super().__init__(total_steps, global_batch, warmup_steps, warmup_samples)
        samples = parse_optional_count(decay_samples, "sched.decay_samples")
        self.decay_end = (
            math.ceil(samples / global_batch) if samples is not None
            else int(decay_steps) if decay_steps is not None else total_steps
        )
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.decay_end - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
