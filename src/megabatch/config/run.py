"""A run's settings parsed once: frozen, typed, every count and duration a number.

``validate(cfg)`` checks the composed config; ``RunSettings.of(cfg)`` then reads what the run's objects need into
frozen dataclasses, once (``RunParts.build`` and ``step_without_data`` make it, and hand it down): ``batch=4k`` is
4096 there, ``trainer.max_samples=12.8M`` 12,800,000, ``trainer.time_limit=3h50m`` 13,800.0 seconds, a choice one
of its ``Literal`` values. Nothing below the entry points parses a count again. The groups built from a
``_target_`` (``model``'s builder, ``loss``, ``sched``, ``logger``, ``optim``'s optimizer) keep their own keys and
are built from the composed config; the model's run settings are ``ModelSettings``.

    settings = RunSettings.of(validate(cfg))
    settings.batch, settings.trainer.sub_batch, settings.trainer.time_limit_s   # 1048576, 'auto', None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from omegaconf import DictConfig

from . import parse_count, parse_duration, parse_optional_count, parse_samples_total
from .schema import ModelSettings, loss_weights, model_settings

Precision = Literal["auto", "bf16", "fp16", "fp32"]
FeatureDtype = Literal["auto", "fp32", "bf16"]
Parallel = Literal["ddp", "fsdp"]
FsdpReduce = Literal["auto", "sub_batch", "step"]


@dataclass(frozen=True)
class TrainerSettings:
    """``trainer.*``, parsed: the run's length (exactly one of ``max_steps``, ``epochs`` and ``max_samples``, the
    last a number of samples), its sub-batches (a count, ``auto`` or ``None``: one pass), its precision, its
    checkpoints and log, its stops (``time_limit_s``: seconds), its parallelism and its offload."""

    max_steps: int | None
    epochs: int | None
    max_samples: int | None
    sub_batch: int | Literal["auto"] | None
    memory_fraction: float
    precision: Precision
    feature_dtype: FeatureDtype
    ckpt_every: int | None
    keep_ckpts: int | None
    log_every: int
    stop_at_step: int | None
    time_limit_s: float | None
    offload: bool
    offload_dir: str | None
    prefetch_gb: float | Literal["auto"]
    parallel: Parallel
    fsdp_reduce: FsdpReduce
    keep_graph: bool | int | Literal["auto"]
    max_bad_steps: int
    tf32: bool

    @classmethod
    def of(cls, trainer: DictConfig) -> TrainerSettings:
        sub_batch = trainer.sub_batch
        return cls(
            max_steps=None if trainer.max_steps is None else int(trainer.max_steps),
            epochs=None if trainer.epochs is None else int(trainer.epochs),
            max_samples=None if trainer.max_samples is None else
            parse_samples_total(trainer.max_samples, "trainer.max_samples"),
            sub_batch="auto" if sub_batch == "auto" else parse_optional_count(sub_batch, "trainer.sub_batch"),
            memory_fraction=float(trainer.memory_fraction),
            precision=trainer.precision,
            feature_dtype=trainer.feature_dtype,
            ckpt_every=trainer.ckpt_every,
            keep_ckpts=trainer.keep_ckpts,
            log_every=int(trainer.log_every),
            stop_at_step=trainer.stop_at_step,
            time_limit_s=parse_duration(trainer.time_limit, "trainer.time_limit"),
            offload=bool(trainer.offload),
            offload_dir=trainer.offload_dir,
            prefetch_gb=trainer.prefetch_gb if trainer.prefetch_gb == "auto" else float(trainer.prefetch_gb),
            parallel=trainer.parallel,
            fsdp_reduce=trainer.fsdp_reduce,
            keep_graph=trainer.keep_graph,
            max_bad_steps=int(trainer.max_bad_steps),
            tf32=bool(trainer.tf32),
        )


@dataclass(frozen=True)
class RunSettings:
    """What a run's objects read of its config, parsed once: the global batch (a number of samples), the seed,
    ``trainer.*`` (``TrainerSettings``), the model's run settings (``ModelSettings``), the loss's weights
    (``loss.caption_weight``, ``loss.contrastive_weight``) and ``data.train.num_samples`` (``None``: counted)."""

    batch: int
    seed: int
    trainer: TrainerSettings
    model: ModelSettings
    caption_weight: float
    contrastive_weight: float
    num_samples: int | None

    @classmethod
    def of(cls, cfg: DictConfig) -> RunSettings:
        caption, contrastive = loss_weights(cfg.loss)
        return cls(batch=parse_count(cfg.batch, "batch"), seed=int(cfg.seed), trainer=TrainerSettings.of(cfg.trainer),
                   model=model_settings(cfg.model), caption_weight=caption, contrastive_weight=contrastive,
                   num_samples=parse_optional_count(cfg.data.train.num_samples, "data.train.num_samples"))
