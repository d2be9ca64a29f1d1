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

from dataclasses import dataclass, fields
from typing import Literal

from omegaconf import DictConfig

from . import parse_count, parse_duration, parse_optional_count, parse_samples_total
from .schema import ModelSettings, caption_warmup, loss_weights, model_settings

Precision = Literal["auto", "bf16", "fp16", "fp32"]
FeatureDtype = Literal["auto", "fp32", "bf16"]
Parallel = Literal["ddp", "fsdp"]
FsdpReduce = Literal["auto", "sub_batch", "step"]


@dataclass(frozen=True)
class TrainerSettings:
    """``trainer.*``, parsed: the run's length (exactly one of ``max_steps``, ``epochs`` and ``max_samples``, the
    last a number of samples), its sub-batches (a count, ``auto`` or ``None``: one pass; or a NaFlex tower's image
    patches, ``sub_batch_tokens``), its precision, its
    checkpoints and log, its stops (``time_limit_s``: seconds), its parallelism and its offload."""

    max_steps: int | None
    epochs: int | None
    max_samples: int | None
    sub_batch: int | Literal["auto"] | None
    sub_batch_tokens: int | None
    memory_fraction: float
    precision: Precision
    feature_dtype: FeatureDtype
    ckpt_every: int | None
    keep_ckpts: int | None
    ckpt_async: bool
    log_every: int
    stop_at_step: int | None
    time_limit_s: float | None
    offload: bool
    offload_dir: str | None
    prefetch_gb: float | Literal["auto"]
    parallel: Parallel
    fsdp_reduce: FsdpReduce
    fsdp_shard_size: int | Literal["auto"]
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
            sub_batch_tokens=parse_optional_count(trainer.sub_batch_tokens, "trainer.sub_batch_tokens"),
            memory_fraction=float(trainer.memory_fraction),
            precision=trainer.precision,
            feature_dtype=trainer.feature_dtype,
            ckpt_every=trainer.ckpt_every,
            keep_ckpts=trainer.keep_ckpts,
            ckpt_async=bool(trainer.ckpt_async),
            log_every=int(trainer.log_every),
            stop_at_step=trainer.stop_at_step,
            time_limit_s=parse_duration(trainer.time_limit, "trainer.time_limit"),
            offload=bool(trainer.offload),
            offload_dir=trainer.offload_dir,
            prefetch_gb=trainer.prefetch_gb if trainer.prefetch_gb == "auto" else float(trainer.prefetch_gb),
            parallel=trainer.parallel,
            fsdp_reduce=trainer.fsdp_reduce,
            fsdp_shard_size=trainer.fsdp_shard_size,
            keep_graph=trainer.keep_graph,
            max_bad_steps=int(trainer.max_bad_steps),
            tf32=bool(trainer.tf32),
        )


def _strings(value) -> str | tuple[str, ...] | None:
    """A key that takes one string or several: a string stays one, a list becomes a tuple."""
    return value if value is None or isinstance(value, str) else tuple(str(item) for item in value)


def _numbers(value) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(item) for item in value)


@dataclass(frozen=True)
class AugmentSettings:
    """``data.train.augment``: RandomResizedCrop's ``scale`` and ``ratio`` ranges."""

    scale: tuple[float, ...]
    ratio: tuple[float, ...]


@dataclass(frozen=True)
class DataTrainSettings:
    """``data.train.*``, parsed: ``urls`` (``None``: the embedded digits; a pattern, ``::``-joined patterns, or a
    tuple of them), ``num_samples`` a number (``None``: counted from the shards), the caption and negatives keys,
    the stored teacher's key, the augmentation."""

    urls: str | tuple[str, ...] | None
    mode: Literal["epoch", "resampled"]
    split: Literal["auto", "position", "shard", "indexed"]
    weights: tuple[float, ...] | None
    num_samples: int | None
    shuffle_buffer: int
    streams: int
    text_key: str | tuple[str, ...]
    text_probs: tuple[float, ...] | None
    negatives_key: str | None
    negatives: int
    teacher_key: str | None
    augment: AugmentSettings
    image_features_key: str | None = None


@dataclass(frozen=True)
class NaFlexDataSettings:
    """``data.naflex``: the sequence lengths a NaFlex tower's sub-batches draw (``None``: the model's
    ``max_seq_len``) and the widest aspect ratio a sample may have (``data/naflex.py``)."""

    seq_lens: tuple[int, ...] | None = None
    max_aspect: float = 20.0


@dataclass(frozen=True)
class DataSettings:
    """``data.*``, parsed: the cache folder, the loader's workers and how they start, where JPEGs are decoded
    (``decode_ahead_gb`` and ``decode_threads``: a number or ``auto``), and ``train`` (``DataTrainSettings``)."""

    cache_dir: str
    num_workers: int
    worker_start: Literal["auto", "fork", "forkserver"]
    decode: Literal["auto", "cpu", "gpu"]
    decode_ahead_gb: float | Literal["auto"]
    decode_threads: int | Literal["auto"]
    train: DataTrainSettings
    naflex: NaFlexDataSettings = NaFlexDataSettings()

    @classmethod
    def of(cls, data: DictConfig) -> DataSettings:
        train, naflex = data.train, data.get("naflex")
        naflex = NaFlexDataSettings() if naflex is None else NaFlexDataSettings(
            None if naflex.seq_lens is None else tuple(int(n) for n in naflex.seq_lens), float(naflex.max_aspect))
        return cls(
            cache_dir=str(data.cache_dir), num_workers=int(data.num_workers),
            worker_start=data.get("worker_start", "auto"), decode=data.decode,
            decode_ahead_gb=data.decode_ahead_gb if data.decode_ahead_gb == "auto" else float(data.decode_ahead_gb),
            decode_threads=data.decode_threads if data.decode_threads == "auto" else int(data.decode_threads),
            train=DataTrainSettings(
                urls=_strings(train.urls), mode=train.mode, split=train.split, weights=_numbers(train.weights),
                num_samples=parse_optional_count(train.num_samples, "data.train.num_samples"),
                shuffle_buffer=int(train.shuffle_buffer), streams=int(train.streams), text_key=_strings(train.text_key),
                text_probs=_numbers(train.text_probs), negatives_key=train.negatives_key,
                negatives=int(train.negatives), teacher_key=train.get("teacher_key"),
                augment=AugmentSettings(_numbers(train.augment.scale), _numbers(train.augment.ratio)),
                image_features_key=train.get("image_features_key")), naflex=naflex)


@dataclass(frozen=True)
class OptimSettings:
    """``optim.*``, parsed: the peak ``lr`` scaled from ``base_batch`` (a number) by ``lr_scaling``, the weight
    decay, the clip, ``layer_decay`` (``{tower: decay or None}``, or ``None`` where it is off) and ``optimizer``,
    the ``_partial_`` optimizer class the run instantiates over its parameter groups (a config node: a target)."""

    lr: float
    lr_scaling: str | None
    base_batch: int | None
    weight_decay: float
    grad_clip: float | None
    layer_decay: dict[str, float | None] | None
    name: str | None
    optimizer: DictConfig

    @classmethod
    def of(cls, optim: DictConfig) -> OptimSettings:
        decay = optim.get("layer_decay")
        if isinstance(decay, (int, float)):  # one number: both towers'
            decay = {"image": float(decay), "text": float(decay)}
        elif decay is not None:
            decay = dict(decay)
        return cls(lr=float(optim.lr), lr_scaling=optim.lr_scaling,
                   base_batch=parse_optional_count(optim.base_batch, "optim.base_batch"),
                   weight_decay=float(optim.weight_decay),
                   grad_clip=None if optim.grad_clip is None else float(optim.grad_clip),
                   layer_decay=decay if decay and any(value is not None for value in decay.values()) else None,
                   name=optim.get("name"), optimizer=optim.optimizer)


@dataclass(frozen=True)
class EmaSettings:
    """``ema.*``: the moving average's ``decay`` (``None``: off), how many steps apart it moves, its warm-up."""

    decay: float | None = None
    every: int = 1
    warmup_power: float | None = 0.6667

    @classmethod
    def of(cls, ema: DictConfig | None) -> EmaSettings:
        return cls() if ema is None else cls(ema.decay, int(ema.every), ema.warmup_power)


@dataclass(frozen=True)
class SelfDistillSettings:
    """``self_distill.*`` (``schema.check_self_distill`` checked them): SigLIP 2's late terms, the local-to-global
    self-distillation (``weight``) and the masked prediction (``masked_weight``), from the share ``start`` of
    training on; the student's views and heads (``views``: ``models.views.ViewsCfg``'s keys); the temperatures and
    momenta of the teacher and the centers."""

    weight: float = 0.0
    masked_weight: float = 0.0
    start: float = 0.8
    local_crops: int = 8
    local_size: int = 96
    crop_scale: tuple[float, float] = (0.05, 0.4)
    mask_ratio: float = 0.5
    prototypes: int = 4096
    hidden: int = 2048
    bottleneck: int = 256
    student_temp: float = 0.1
    teacher_temp: float = 0.04
    center_momentum: float = 0.9
    teacher_momentum: float = 0.996

    @property
    def on(self) -> bool:
        return self.weight > 0 or self.masked_weight > 0

    @property
    def views(self) -> dict:
        """The student's views and heads (``ViewsCfg``'s keys)."""
        return {"local_crops": self.local_crops, "local_size": self.local_size, "crop_scale": self.crop_scale,
                "mask_ratio": self.mask_ratio, "prototypes": self.prototypes, "hidden": self.hidden,
                "bottleneck": self.bottleneck, "distill": self.weight > 0, "masked": self.masked_weight > 0}

    @classmethod
    def of(cls, node: DictConfig | None) -> SelfDistillSettings:
        if node is None:
            return cls()
        values = {spec.name: node[spec.name] for spec in fields(cls) if spec.name in node}
        if "crop_scale" in values:
            values["crop_scale"] = tuple(float(v) for v in values["crop_scale"])
        return cls(**values)


@dataclass(frozen=True)
class DistillSettings:
    """``distill.*``: the teacher (``None``: no distillation; ``stored``: embeddings read from the shards; an open_clip
    architecture, a checkpoint or an open_clip folder), its weights, the term's weight and temperature, whether the
    teacher is compiled (``None``: as ``model.compile``)."""

    teacher: str | None = None
    pretrained: str | None = None
    weight: float = 1.0
    temperature: float | None = None
    compile: bool | None = None

    @classmethod
    def of(cls, distill: DictConfig | None) -> DistillSettings:
        if distill is None:
            return cls()
        return cls(None if distill.teacher is None else str(distill.teacher), distill.pretrained, float(distill.weight),
                   distill.temperature, distill.get("compile"))


@dataclass(frozen=True)
class EvalSetSettings:
    """One evaluation set, ``eval.<name>``, parsed (``schema.EvalConfig``'s keys, its defaults for the keys a set
    leaves out): a list of class names or templates a tuple, a named set a string. Evaluation (``run_zeroshot``:
    in a run and in ``scripts/evaluate.py``) reads every set through it."""

    name: str
    every: int | None
    at_end: bool
    task: Literal["zeroshot", "retrieval", "captioning", "image_caption_selection", "linear_probe",
                  "dense_probe"] = "zeroshot"
    format: Literal["wds", "folder", "objectnet", "clip_benchmark"] = "wds"
    split: str = "test"
    root: str | None = None
    urls: str | None = None
    train_split: str = "train"
    val_split: str | None = None
    train_urls: str | None = None
    val_urls: str | None = None
    val_proportion: float = 0.2
    fewshot: int | None = None
    probe_lr: float = 0.1
    probe_epochs: int = 10
    probe_batch_size: int = 64
    probe_seed: int = 0
    mosaic: int = 2
    jsonl: str | None = None
    classnames: str | tuple[str, ...] | None = None
    templates: str | tuple[str, ...] | None = None
    subset_wnids_from: str | None = None
    batch_size: int = 256
    num_workers: int = 4
    chunk: int = 1024
    weights: Literal["raw", "ema", "both", "auto"] = "auto"
    seq_len: int | None = None  # a NaFlex tower's patches per image (models/naflex.py); None: its max_seq_len

    @classmethod
    def of(cls, node) -> EvalSetSettings:
        """``node`` (an ``eval.<name>`` config, or settings already) as settings."""
        if isinstance(node, cls):
            return node
        values = {spec.name: node[spec.name] for spec in fields(cls) if spec.name in node}
        for key in ("classnames", "templates"):
            if key in values:
                values[key] = _strings(values[key])
        return cls(**values)


@dataclass(frozen=True)
class RunSettings:
    """What a run's objects read of its config, parsed once: the global batch (a number of samples), the seed,
    ``trainer.*`` (``TrainerSettings``), ``data.*`` (``DataSettings``), ``optim.*``, ``ema.*``, ``distill.*``,
    ``self_distill.*``, the
    model's run settings (``ModelSettings``) and the loss's weights (``loss.caption_weight``,
    ``loss.contrastive_weight``, ``loss.caption_warmup``)."""

    batch: int
    seed: int
    trainer: TrainerSettings
    model: ModelSettings
    caption_weight: float
    contrastive_weight: float
    data: DataSettings
    optim: OptimSettings
    ema: EmaSettings
    distill: DistillSettings
    self_distill: SelfDistillSettings = SelfDistillSettings()
    caption_warmup: float = 0.0

    @classmethod
    def of(cls, cfg: DictConfig) -> RunSettings:
        caption, contrastive = loss_weights(cfg.loss)
        return cls(batch=parse_count(cfg.batch, "batch"), seed=int(cfg.seed), trainer=TrainerSettings.of(cfg.trainer),
                   model=model_settings(cfg.model), caption_weight=caption, contrastive_weight=contrastive,
                   data=DataSettings.of(cfg.data), optim=OptimSettings.of(cfg.optim),
                   ema=EmaSettings.of(cfg.get("ema")), distill=DistillSettings.of(cfg.get("distill")),
                   self_distill=SelfDistillSettings.of(cfg.get("self_distill")),
                   caption_warmup=caption_warmup(cfg.loss))
