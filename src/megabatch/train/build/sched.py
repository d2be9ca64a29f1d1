"""Learning-rate schedules as multipliers of the peak lr; warmup in steps, samples or epochs."""

from __future__ import annotations

import logging
import math

from ...config import ConfigError, parse_optional_count

log = logging.getLogger("megabatch")


def _warmup_steps(warmup_steps, warmup_samples, warmup_epochs, global_batch: int, steps_per_epoch: int) -> int:
    given = [key for key, value in (("sched.warmup_steps", warmup_steps), ("sched.warmup_samples", warmup_samples),
                                    ("sched.warmup_epochs", warmup_epochs)) if value is not None]
    if len(given) > 1:
        raise ConfigError(f"set one of sched.warmup_steps, sched.warmup_samples and sched.warmup_epochs, not "
                          f"{' and '.join(given)} (the others null)")
    if warmup_epochs is not None:
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, (int, float)) or warmup_epochs < 0:
            raise ConfigError(f"sched.warmup_epochs={warmup_epochs!r} must be a number of epochs >= 0, e.g. 0.5")
        return math.ceil(warmup_epochs * steps_per_epoch)
    samples = parse_optional_count(warmup_samples, "sched.warmup_samples")
    if samples is not None:
        return math.ceil(samples / global_batch)
    return int(warmup_steps or 0)


class ConstantSchedule:
    """Linear warmup, then constant. ``steps_per_epoch`` turns ``warmup_epochs`` into steps."""

    def __init__(self, total_steps: int, global_batch: int, warmup_steps=None, warmup_samples=None,
                 warmup_epochs=None, steps_per_epoch: int = 1):
        self.total_steps = total_steps
        self.warmup = _warmup_steps(warmup_steps, warmup_samples, warmup_epochs, global_batch, steps_per_epoch)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return 1.0

    def state_dict(self) -> dict:
        """The schedule's shape (its lengths in steps): a resumed run checks that it follows the same curve."""
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        """Warn where the resumed run's schedule differs from the checkpoint's (another batch, step
        count or warm-up changes the learning rate from here on); this run's own is kept."""
        changed = {key: (value, getattr(self, key, None)) for key, value in state.items()
                   if getattr(self, key, None) != value}
        if changed:
            log.warning("resuming with another learning-rate schedule than the checkpoint's (%s): the rest of the "
                        "run follows this run's", ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))


class CosineSchedule(ConstantSchedule):
    """Linear warmup, then cosine decay to ``min_lr_ratio`` at ``total_steps`` (or at
    ``decay_samples`` / ``decay_steps`` when given)."""

    def __init__(
        self,
        total_steps: int,
        global_batch: int,
        warmup_steps=None,
        warmup_samples=None,
        warmup_epochs=None,
        steps_per_epoch: int = 1,
        decay_steps=None,
        decay_samples=None,
        min_lr_ratio: float = 0.0,
    ):
        super().__init__(total_steps, global_batch, warmup_steps, warmup_samples, warmup_epochs, steps_per_epoch)
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
