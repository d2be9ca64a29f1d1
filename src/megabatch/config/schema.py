"""The typed config and its one validation point.

Types. The dataclasses below are registered in Hydra's ConfigStore as ``<group>/schema`` and named
first in the defaults list of every option file of ``trainer``, ``data``, ``eval`` and ``optim``, so
composing a config gives each value its type (``trainer.max_steps=abc`` is refused, naming the
key) and refuses keys that do not exist.

Defaults live once. A value every option file of a group sets lives in that YAML file
(``configs/<group>/*.yaml``, commented there) and its field here has none (``MISSING``). A key
only some option files set (``eval.<name>.root``, ``eval.<name>.chunk``, ...) has its default here and nowhere
else. The code reads ``cfg.key`` in either case, never ``cfg.get(key, default)``. The groups whose
options are ``_target_`` classes with their own arguments (``model``, ``loss``, ``sched``,
``logger``) keep their own keys; what can be checked of them before building is checked below.

Checks. ``validate(cfg)`` runs first in every run (``train.run`` and ``Trainer``), before a
process group, a model or a loader exists: ranges, choices and combinations (``loss.impl=triton``
without CUDA, ``trainer.offload_dir`` without ``trainer.offload``, an evaluation set without its
data, ...). Every error is a ``ConfigError`` naming the key and the fix.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from . import ConfigError, no_such_option, parse_count, parse_duration, parse_optional_count, parse_samples_total

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
FEATURE_DTYPES = ("auto", "fp32", "bf16")
DECODES = ("auto", "cpu", "gpu")
# model.preprocess.* (open_clip's PreprocessCfg less the size, which is the model's)
PREPROCESS_KEYS = ("mean", "std", "interpolation", "resize_mode", "fill_color")
INTERPOLATIONS = ("bicubic", "bilinear", "nearest")
RESIZE_MODES = ("shortest", "longest", "squash")


@dataclass
class TrainerConfig:
    max_steps: int | None = MISSING
    epochs: int | None = MISSING
    max_samples: Any = MISSING        # samples seen (12.8M, 1B: decimal) or null
    sub_batch: Any = MISSING          # a count (512, 4k), auto or null
    sub_batch_tokens: Any = MISSING   # a NaFlex tower's image patches per sub-batch (200k) or null
    memory_fraction: float = MISSING
    precision: str = MISSING
    ckpt_every: int | None = MISSING
    keep_ckpts: int | None = MISSING
    ckpt_async: bool = MISSING
    log_every: int = MISSING
    stop_at_step: int | None = MISSING
    time_limit: Any = MISSING         # a duration (3h50m) or null
    device: str = MISSING
    dist_backend: str = MISSING
    dist_timeout_s: float = MISSING
    offload: bool = MISSING
    offload_dir: str | None = MISSING
    prefetch_gb: Any = MISSING        # auto or a number of GB
    feature_dtype: str = MISSING
    parallel: str = MISSING
    fsdp_reduce: str = MISSING
    fsdp_shard_size: Any = MISSING   # auto or a count of ranks
    keep_graph: Any = MISSING         # auto, true, false or a count of sub-batches
    max_bad_steps: int = MISSING
    tf32: bool = MISSING


@dataclass
class AugmentConfig:
    scale: list[float] = MISSING
    ratio: list[float] = MISSING


@dataclass
class DataTrainConfig:
    urls: Any = MISSING               # null (the digits), a brace pattern, ::-joined patterns, a list
    mode: str = MISSING
    split: str = MISSING
    weights: list[float] | None = MISSING
    num_samples: Any = MISSING        # a count or null (read sizes.json)
    shuffle_buffer: int = MISSING
    streams: int = MISSING
    text_key: Any = MISSING           # a key (txt, json:caption) or a list of them
    text_probs: list[float] | None = MISSING
    negatives_key: str | None = MISSING    # hard negatives: a JSON list (json:negatives) or a file of lines
    negatives: int = MISSING               # hard negatives per sample
    teacher_key: str | None = None         # distill.teacher=stored: each sample's stored teacher embeddings
    image_features_key: str | None = None  # model.image_features=stored: each sample's stored image features
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class NaFlexDataConfig:
    """``data.naflex``: what a NaFlex image tower's data path draws (``model.image.naflex``; ``data/naflex.py``)."""
    seq_lens: list[int] | None = None  # each sub-batch's patches per image, drawn; null: the model's max_seq_len
    max_aspect: float = 20.0           # a longer side beyond this times the shorter: the sample skipped, counted


@dataclass
class DataConfig:
    cache_dir: str = MISSING
    num_workers: int = MISSING
    worker_start: str = MISSING       # auto | fork | forkserver (data/worker_start.py)
    decode: str = MISSING
    decode_ahead_gb: Any = MISSING    # auto or a number of GB
    decode_threads: Any = MISSING     # auto or a number >= 2
    train: DataTrainConfig = field(default_factory=DataTrainConfig)
    naflex: NaFlexDataConfig = field(default_factory=NaFlexDataConfig)


@dataclass
class EvalConfig:
    """One evaluation set, ``eval.<name>`` (``eval=[imagenet,imagenet_v2,retrieval]`` selects several)."""
    name: str = MISSING               # the set's name: its package, its log key eval/<name>/...
    every: int | None = MISSING
    at_end: bool = MISSING
    # only some eval options set these
    task: str = "zeroshot"            # zeroshot | retrieval | captioning (BLEU, CIDEr) | image_caption_selection
    #                                   | linear_probe | dense_probe (the linear probe on patch tokens)
    format: str = "wds"               # wds | folder | objectnet | clip_benchmark (root: CLIP_benchmark's wds layout)
    split: str = "test"               # format=clip_benchmark: the split folder under root
    root: str | None = None
    urls: str | None = None
    # task=linear_probe (eval/probe.py): the training and validation splits, the shots, the classifier's training
    train_split: str = "train"        # format=clip_benchmark or folder: the training split's folder under root
    val_split: str | None = None      # null: root/val where it exists, else val_proportion of the training split
    train_urls: str | None = None     # format=wds: the training split's shards (digits: its own)
    val_urls: str | None = None
    val_proportion: float = 0.2       # without a validation split; 0: no weight-decay search (weight decay 0)
    fewshot: int | None = None        # k training images a class; null: all
    probe_lr: float = 0.1
    probe_epochs: int = 10
    probe_batch_size: int = 64
    probe_seed: int = 0
    mosaic: int = 2                   # task=dense_probe (eval/dense.py): images a side of a scene
    jsonl: str | None = None
    classnames: Any = None            # a named set or a list; null: the set named like eval.name
    templates: Any = None
    subset_wnids_from: str | None = None
    batch_size: int = 256
    num_workers: int = 4
    chunk: int = 1024
    weights: str = "auto"             # raw | ema | both | auto (both with ema.decay, else raw)
    seq_len: int | None = None        # a NaFlex tower's patches per image (aspect kept); null: its max_seq_len


@dataclass
class OptimConfig:
    lr: float = MISSING
    lr_scaling: str | None = MISSING
    base_batch: Any = MISSING
    weight_decay: float = MISSING
    grad_clip: float | None = MISSING
    layer_decay: Any = field(default_factory=lambda: {"image": None, "text": None})  # per tower, or one number
    name: str | None = None           # optim=timm: timm's optimizer name
    optimizer: Any = MISSING          # a _partial_ torch.optim class and its arguments


@dataclass
class EmaConfig:
    decay: float | None = None
    every: int = 1
    warmup_power: float | None = 0.6667


@dataclass
class SelfDistillConfig:
    weight: float = 0.0
    masked_weight: float = 0.0
    start: float = 0.8
    local_crops: int = 8
    local_size: int = 96
    crop_scale: list = field(default_factory=lambda: [0.05, 0.4])
    mask_ratio: float = 0.5
    prototypes: int = 4096
    hidden: int = 2048
    bottleneck: int = 256
    student_temp: float = 0.1
    teacher_temp: float = 0.04
    center_momentum: float = 0.9
    teacher_momentum: float = 0.996


@dataclass
class DistillConfig:
    teacher: str | None = None
    pretrained: str | None = None
    weight: float = 1.0
    temperature: float | None = None
    compile: bool | None = None


@dataclass
class WandbConfig:
    project: str = MISSING
    entity: str | None = MISSING
    name: str | None = MISSING        # null: the run's name (in a sweep, <sweep>/<job>)
    group: str | None = MISSING       # null: the sweep's name in a multirun (its jobs grouped), none otherwise
    id: str | None = MISSING
    mode: str = MISSING


@dataclass
class TrackioConfig:
    project: str = MISSING
    name: str | None = MISSING        # null: the run's name (in a sweep, <sweep>/<job>)
    group: str | None = MISSING       # null: the sweep's name in a multirun, none otherwise
    space_id: str | None = MISSING    # a Hugging Face Space to log to; null: the local database


@dataclass
class TensorboardConfig:
    dir: str | None = MISSING         # null: <run_dir>/tensorboard
    flush_secs: float = MISSING


SCHEMAS = {"trainer": TrainerConfig, "data": DataConfig, "optim": OptimConfig}  # eval: per set (check_eval)
# logger: several options combine in one section ('logger=[tensorboard,wandb]'), so its keys are checked at
# validation rather than by a schema in each option (which would reset the sections set before it)
LOGGER_SECTIONS = {"wandb": WandbConfig, "tensorboard": TensorboardConfig, "trackio": TrackioConfig}


def register() -> None:
    """Store the schemas as ``<group>/schema`` (idempotent); the option files name them first.
    Each evaluation set sits in its own package (``eval.<name>``) and types itself with ``eval/schema``."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in {**SCHEMAS, "eval": EvalConfig}.items():
        store.store(group=group, name="schema", node=schema)


def validate(cfg: DictConfig) -> DictConfig:
    """Check a composed ``train.yaml`` config; return it unchanged. Idempotent."""
    for group, schema in SCHEMAS.items():
        check_known_keys(cfg[group], schema, group)
    check_run(cfg)
    check_logger(cfg.logger)
    check_trainer(cfg.trainer)
    check_data(cfg.data)
    check_eval(cfg.eval)
    check_optim(cfg.optim)
    torch_muon = str(cfg.optim.optimizer.get("_target_", "")).endswith("MuonWithAdamW")
    if (torch_muon or str(cfg.optim.get("name")) in ("muon", "adamuon")) and cfg.trainer.parallel == "fsdp":
        raise ConfigError(f"{'optim=muon' if torch_muon else f'optim.name={cfg.optim.name}'} with "
                          "trainer.parallel=fsdp: Muon orthogonalises each whole matrix, and FSDP holds a shard of it "
                          "on each rank; use trainer.parallel=ddp, or an element-wise optimizer (optim=adamw, "
                          "optim=timm optim.name=lamb)")
    check_ema(cfg.get("ema"), cfg.eval, cfg.trainer)
    check_distill(cfg.get("distill"), cfg.loss, cfg.data.train)
    check_self_distill(cfg.get("self_distill"), cfg.model)
    check_image_features(cfg)
    check_schedule(cfg.sched)
    check_buildable(cfg.sched, "sched", total_steps=1, global_batch=parse_count(cfg.batch, "batch"), steps_per_epoch=1)
    check_loss(cfg.loss, cfg.trainer.device)
    check_model(cfg.model)
    on_cpu = not runs_on_cuda(cfg.trainer.device)
    if model_settings(cfg.model).fp8 and on_cpu:  # the GPU's own capability is checked once chosen (models/fp8.py)
        raise ConfigError("model.fp8=true trains the towers' matmuls in FP8 on a GPU's FP8 tensor cores, and this "
                          "run is on the CPU: set model.fp8=false")
    check_logit_bias(cfg.loss, cfg.model)
    check_negatives(cfg.data.train, cfg.loss)
    return cfg


def check_negatives(train: DictConfig, loss: DictConfig) -> None:
    """Hard negatives are extra columns of a softmax: the sigmoid loss refuses them."""
    from hydra.utils import get_class

    if train.negatives_key is not None and not getattr(get_class(loss._target_), "takes_negatives", True):
        raise ConfigError(f"data.train.negatives_key={train.negatives_key} with "
                          f"{loss._target_.rsplit('.', 1)[-1]}: hard negatives are extra columns of a softmax over "
                          "the captions; use loss=infcl, local, disco or vanilla, or data.train.negatives_key=null")
    if train.negatives_key is not None and loss_weights(loss)[0] > 0:
        raise ConfigError(f"loss.caption_weight={loss_weights(loss)[0]} with hard negatives (data.train.negatives_key="
                          f"{train.negatives_key}): the caption loss reads each sample's own caption; set "
                          "loss.caption_weight=0 or data.train.negatives_key=null")


# The keys of the digits demo's optimizer and schedule, and the option files of train.yaml's defaults
# that hold their values: a run on real data without a recipe would otherwise train with them unawares
DIGITS_DEMO = {"optim.lr": "optim/adamw.yaml", "sched.warmup_steps": "sched/cosine.yaml",
               "trainer.max_steps": "trainer/default.yaml"}


@functools.cache
def digits_demo_value(key: str):
    """The digits demo's value of ``key`` (one of ``DIGITS_DEMO``), as its option file sets it."""
    from .compose import CONFIGS

    return OmegaConf.select(OmegaConf.load(CONFIGS / DIGITS_DEMO[key]), key.split(".", 1)[1])


def recipe_warning(cfg: DictConfig) -> str | None:
    """A warning for a run on real data (``data.train.urls`` set) that names no recipe and keeps
    the digits demo's optimizer settings; ``None`` when a recipe or the user's own values are in force."""
    if cfg.get("recipe") or cfg.data.train.urls is None:
        return None
    kept = [f"{key}={OmegaConf.select(cfg, key)}" for key in DIGITS_DEMO
            if OmegaConf.select(cfg, key) == digits_demo_value(key)]
    if not kept:
        return None
    return (f"no recipe: {', '.join(kept)} are the digits demo's settings, not a real run's. Start from a "
            "recipe, e.g. experiment=openclip_b32_laion400m (the list: ls configs/experiment; "
            "docs/recipes.md), or set those keys yourself")


def check_known_keys(node: DictConfig, schema: type, key: str) -> None:
    """Refuse keys that a ``+group.key=value`` override added to a typed section: nothing reads them."""
    known = {spec.name: spec for spec in fields(schema)}
    for name in node:
        if name not in known:
            raise ConfigError(no_such_option(f"{key}.{name}", known))
        nested = known[name].default_factory  # a nested section (data.train, data.train.augment)
        if isinstance(nested, type) and is_dataclass(nested):
            check_known_keys(node[name], nested, f"{key}.{name}")


def choice(value, key: str, options) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r}; use one of {', '.join(map(str, options))}")


def at_least(value, key: str, low, example: str) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{key}={value!r} must be at least {low}; e.g. {key}={example}")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec
        return module in __import__("sys").modules


def check_logger(logger: DictConfig) -> None:
    for name in logger:
        if name not in LOGGER_SECTIONS:
            raise ConfigError(f"logger.{name}: no such logger; choose with logger=jsonl|tensorboard|wandb|trackio or "
                              "several: 'logger=[jsonl,tensorboard,wandb]'")
        if logger[name] is not None:
            check_known_keys(logger[name], LOGGER_SECTIONS[name], f"logger.{name}")
    if logger.get("trackio") is not None and not installed("trackio"):
        raise ConfigError("logger=trackio needs the trackio package (an optional dependency): pip install trackio, "
                          "or log with logger=wandb or tensorboard")
    if logger.wandb is not None:
        choice(logger.wandb.mode, "logger.wandb.mode", ("offline", "online", "disabled"))
    if logger.tensorboard is not None and not logger.tensorboard.flush_secs > 0:
        raise ConfigError(f"logger.tensorboard.flush_secs={logger.tensorboard.flush_secs}: give seconds > 0, e.g. 30")


def check_run(cfg: DictConfig) -> None:
    parse_count(cfg.batch, "batch")
    if not str(cfg.name) or any(sep in str(cfg.name) for sep in ("/", "\\")) or str(cfg.name) in (".", ".."):
        raise ConfigError(f"name={cfg.name!r} names the run directory runs/<name>: give a plain name without "
                          "path separators, e.g. name=b32-1M (run_dir=<path> places a run anywhere)")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed!r} must be a whole number >= 0, e.g. seed=0")
    if cfg.resume not in (None, "", "none", "null", "latest") and not Path(str(cfg.resume)).expanduser().exists():
        raise ConfigError(f"resume={cfg.resume!r}: no such checkpoint (use resume=latest, a .pt file or a .dcp folder)")


def check_trainer(trainer: DictConfig) -> None:
    lengths = {key: trainer[key] for key in ("max_steps", "epochs", "max_samples") if trainer[key] is not None}
    if len(lengths) != 1:
        given = ", ".join(f"trainer.{k}={v}" for k, v in lengths.items()) or "none of them"
        raise ConfigError(f"set exactly one of trainer.max_steps, trainer.epochs and trainer.max_samples, the others "
                          f"null (given: {given}); e.g. trainer.max_steps=null trainer.max_samples=12.8M")
    if trainer.max_samples is not None:
        parse_samples_total(trainer.max_samples, "trainer.max_samples")
    at_least(trainer.max_steps, "trainer.max_steps", 1, "500")
    at_least(trainer.epochs, "trainer.epochs", 1, "32")
    if trainer.sub_batch != "auto":
        parse_optional_count(trainer.sub_batch, "trainer.sub_batch")
    if parse_optional_count(trainer.sub_batch_tokens, "trainer.sub_batch_tokens") is not None \
            and trainer.sub_batch is not None:
        raise ConfigError(f"trainer.sub_batch={trainer.sub_batch} and trainer.sub_batch_tokens="
                          f"{trainer.sub_batch_tokens}: a NaFlex tower's sub-batch is cut by samples or by image "
                          "patches, not both; set one, the other null")
    if not 0 < trainer.memory_fraction <= 1:
        raise ConfigError(f"trainer.memory_fraction={trainer.memory_fraction}: give the share of GPU memory a step "
                          "may use, in (0, 1], e.g. 0.9")
    choice(trainer.precision, "trainer.precision", PRECISIONS)
    choice(trainer.feature_dtype, "trainer.feature_dtype", FEATURE_DTYPES)
    choice(trainer.parallel, "trainer.parallel", ("ddp", "fsdp"))
    choice(trainer.fsdp_reduce, "trainer.fsdp_reduce", ("auto", "sub_batch", "step"))
    shard_size = trainer.fsdp_shard_size
    if shard_size != "auto" and (isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1):
        raise ConfigError(f"trainer.fsdp_shard_size={shard_size!r}: give auto (the ranks of a node) or a count of "
                          "ranks >= 1 that divides the job's (e.g. 8: sharded within each 8-GPU node, replicated "
                          "across them)")
    at_least(trainer.ckpt_every, "trainer.ckpt_every", 0, "100 (0 or null: only at the end)")
    at_least(trainer.keep_ckpts, "trainer.keep_ckpts", 1, "3 (null keeps all)")
    at_least(trainer.log_every, "trainer.log_every", 1, "10")
    at_least(trainer.max_bad_steps, "trainer.max_bad_steps", 1, "10")
    at_least(trainer.stop_at_step, "trainer.stop_at_step", 1, "1000")
    parse_duration(trainer.time_limit, "trainer.time_limit")
    at_least(trainer.dist_timeout_s, "trainer.dist_timeout_s", 1, "600")
    choice(trainer.dist_backend, "trainer.dist_backend", ("auto", "nccl", "gloo"))
    if trainer.device not in ("auto", "cpu", "cuda") and not str(trainer.device).startswith("cuda:"):
        raise ConfigError(f"trainer.device={trainer.device!r}; use auto, cpu or cuda")
    if trainer.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={trainer.device} but this machine has no CUDA GPU; "
                          "use trainer.device=auto or cpu")
    if trainer.offload_dir and not trainer.offload:
        raise ConfigError("trainer.offload_dir is set but trainer.offload=false; set trainer.offload=true "
                          "or drop trainer.offload_dir")
    kept = trainer.keep_graph
    if kept != "auto" and not isinstance(kept, bool) and not (isinstance(kept, int) and kept >= 0):
        raise ConfigError(f"trainer.keep_graph={kept!r}: give how many GradCache sub-batches keep their phase-1 "
                          "graphs: auto (as many as the memory plan leaves room for), true (the last one), false "
                          "(none) or a count, e.g. trainer.keep_graph=4")
    budget = trainer.prefetch_gb
    if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0):
        raise ConfigError(f"trainer.prefetch_gb={budget!r}: give the host memory (GB per rank) the "
                          "loader may read ahead into, e.g. trainer.prefetch_gb=8, 0 to turn it off, or auto")


def check_data(data: DictConfig) -> None:
    train = data.train
    if OmegaConf.is_missing(train, "urls"):
        raise ConfigError("data.train.urls is not set: give your shards, e.g. "
                          "data.train.urls='/data/cc12m/{000000..001242}.tar' (quoted: Hydra reads braces)")
    at_least(data.num_workers, "data.num_workers", 0, "8")
    choice(data.worker_start, "data.worker_start", ("auto", "fork", "forkserver"))
    choice(data.decode, "data.decode", DECODES)
    ahead = data.decode_ahead_gb
    if ahead != "auto" and (isinstance(ahead, bool) or not isinstance(ahead, (int, float)) or ahead < 0):
        raise ConfigError(f"data.decode_ahead_gb={ahead!r}: give the GPU memory (GB per rank) that sub-batches "
                          "decoded ahead of the step may take, e.g. data.decode_ahead_gb=2, or auto (2.5% of the GPU)")
    threads = data.decode_threads
    if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 2):
        raise ConfigError(f"data.decode_threads={threads!r}: give the GPU decoding threads per rank, 2 or more "
                          "(one of them kept for the offload replay), e.g. data.decode_threads=4, or auto "
                          "(4 with hardware JPEG decoders, else 2)")
    naflex = data.get("naflex")
    if naflex is not None:
        lens = naflex.seq_lens
        if lens is not None and (not len(lens) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                       for n in lens)):
            raise ConfigError(f"data.naflex.seq_lens={list(lens)}: give the patches per image each sub-batch may "
                              "draw, e.g. [128,256,576,784] (SigLIP 2's), or null (the model's max_seq_len)")
        if not naflex.max_aspect >= 1:
            raise ConfigError(f"data.naflex.max_aspect={naflex.max_aspect}: give 1 or more (20: a 1 x 4000 image "
                              "is skipped and counted)")
    at_least(train.shuffle_buffer, "data.train.shuffle_buffer", 1, "5000")
    choice(train.split, "data.train.split", ("auto", "position", "shard", "indexed"))
    at_least(train.streams, "data.train.streams", 1, "256")
    choice(train.mode, "data.train.mode", ("epoch", "resampled"))
    if train.mode == "resampled" and train.split not in ("shard", "auto"):
        raise ConfigError("data.train.mode=resampled needs data.train.split=shard (or auto)")
    parse_optional_count(train.num_samples, "data.train.num_samples")
    for key in ("scale", "ratio"):
        values = train.augment[key]
        if len(values) != 2 or not 0 < values[0] <= values[1]:
            raise ConfigError(f"data.train.augment.{key}={list(values)}: give [low, high] with 0 < low <= high")
    keys = train.text_key
    check_text_keys([keys] if isinstance(keys, str) else list(keys) if keys is not None else [], train.text_probs)
    if train.negatives_key is not None and (not str(train.negatives_key) or str(train.negatives_key) == "json:"):
        raise ConfigError(f"data.train.negatives_key={train.negatives_key!r}: give the key of each sample's hard "
                          "negatives, a JSON list (json:negatives) or a text file of one caption a line, or null")
    at_least(train.negatives, "data.train.negatives", 1, "4 (hard negatives per sample)")
    if train.weights is not None and any(w < 0 for w in train.weights):
        raise ConfigError(f"data.train.weights={list(train.weights)}: weights must not be negative")


def check_text_keys(keys: list[str], probs) -> None:
    """``data.train.text_key`` and ``data.train.text_probs``: keys given, one probability per key, >= 0,
    not all 0."""
    if not keys or any(not key or key == "json:" or key in ("__key__", "__url__") for key in keys):
        raise ConfigError(f"data.train.text_key={keys!r}: give the caption's key in the shards (txt), a JSON field "
                          "(json:caption) or a list of them, e.g. data.train.text_key='[txt,json:recaption]'")
    if probs is None:
        return
    probs = list(probs)
    if len(probs) != len(keys) or any(isinstance(p, bool) or not isinstance(p, (int, float)) or p < 0 for p in probs) \
            or not sum(probs) > 0:
        raise ConfigError(f"data.train.text_probs={probs!r}: give one weight >= 0 per key of data.train.text_key "
                          f"({len(keys)}: {', '.join(keys)}), not all 0, e.g. data.train.text_probs="
                          f"[{','.join(['0.5'] * len(keys))}], or null (equal)")


def check_eval(eval_sets: DictConfig) -> None:
    """The evaluation sets (``eval.<name>``, also ``scripts/evaluate.py``'s): each one's values and
    where its data is, checked before a run spends hours training towards an evaluation that
    cannot start."""
    for name in eval_sets:
        check_known_keys(eval_sets[name], EvalConfig, f"eval.{name}")
        check_eval_set(eval_sets[name])
        check_eval_data(eval_sets[name])


def check_eval_set(eval_cfg: DictConfig) -> None:
    key = f"eval.{eval_cfg.name}"
    at_least(eval_cfg.every, f"{key}.every", 1, "1000 (null: only at the end)")
    at_least(eval_cfg.batch_size, f"{key}.batch_size", 1, "256")
    at_least(eval_cfg.chunk, f"{key}.chunk", 1, "1024")
    at_least(eval_cfg.num_workers, f"{key}.num_workers", 0, "4")
    choice(eval_cfg.task, f"{key}.task", ("zeroshot", "retrieval", "captioning", "image_caption_selection",
                                          "linear_probe", "dense_probe"))
    if eval_cfg.task in ("linear_probe", "dense_probe"):
        check_probe(eval_cfg)
    choice(eval_cfg.format, f"{key}.format", ("wds", "folder", "objectnet", "clip_benchmark"))
    choice(eval_cfg.weights, f"{key}.weights", ("auto", "raw", "ema", "both"))
    if eval_cfg.format == "clip_benchmark":  # its files are checked when the set is read (eval/clip_benchmark.py)
        root = os.path.expanduser(str(eval_root(eval_cfg)))
        if not os.path.isdir(root):  # before a run (or a suite of sets) spends hours to reach it
            raise ConfigError(f"{key}.root={eval_cfg.root!r} is not a folder (a CLIP_benchmark dataset: "
                              f"{eval_cfg.split}/nshards.txt, {eval_cfg.split}/0.tar, ..., classnames.txt): download "
                              f"it there, point {key}.root at it, or leave the set out ('~{key}')")
        return
    if eval_cfg.task == "image_caption_selection":
        if not eval_cfg.jsonl:
            raise ConfigError(f"eval={eval_cfg.name} needs {key}.jsonl (rows {{\"image\": ..., \"captions\": [true, "
                              "negative, ...]}})")
        return
    if eval_cfg.task in ("retrieval", "captioning"):
        if not (eval_cfg.jsonl or eval_cfg.urls):
            raise ConfigError(f"eval={eval_cfg.name} needs {key}.jsonl (a JSONL of images and their captions) or "
                              f"{key}.urls (shards)")
        return
    if eval_cfg.format in ("folder", "objectnet"):
        eval_root(eval_cfg)
    if eval_cfg.format == "wds" and not eval_cfg.urls and not embedded_digits(eval_cfg):
        raise ConfigError(f"{key}.urls is not set for eval={eval_cfg.name} (shards with cls + image)")


def check_eval_data(eval_cfg: DictConfig) -> None:
    """Each path an evaluation set reads exists, in its format: an ImageFolder's root holds class folders
    (a linear probe's: its split folders), ObjectNet's root is a folder, a JSONL is a readable file, a local
    shard pattern matches files. Checked at start-up, training or ``scripts/evaluate.py``, so that a typo in
    a root shows before the training, not after it (a CLIP_benchmark folder: ``check_eval_set``)."""
    key = f"eval.{eval_cfg.name}"
    leave_out = f"or leave the set out ('~{key}', or eval=none)"
    if eval_cfg.jsonl:
        path = os.path.expanduser(str(eval_cfg.jsonl))
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ConfigError(f"{key}.jsonl={eval_cfg.jsonl!r}: no readable file there (a JSONL of images and their "
                              f"captions): fix the path, {leave_out}")
    if eval_cfg.task in ("retrieval", "captioning", "image_caption_selection") and eval_cfg.jsonl:
        return
    if eval_cfg.format in ("folder", "objectnet"):
        root = os.path.expanduser(str(eval_root(eval_cfg)))
        if not os.path.isdir(root) or not os.access(root, os.R_OK | os.X_OK):
            what = "the ObjectNet release folder" if eval_cfg.format == "objectnet" else \
                "an ImageFolder: root/<class>/*.JPEG"
            raise ConfigError(f"{key}.root={eval_cfg.root!r}: not a readable folder ({what}): fix the path, "
                              f"{leave_out}")
        if eval_cfg.format == "folder":
            folders = [root] if eval_cfg.task not in ("linear_probe", "dense_probe") else \
                [os.path.join(root, str(split)) for split in (eval_cfg.train_split, eval_cfg.val_split, eval_cfg.split)
                 if split is not None]  # a probe's splits under root
            for folder in folders:
                if not os.path.isdir(folder) or not any(entry.is_dir() for entry in os.scandir(folder)):
                    raise ConfigError(f"{key}.root={eval_cfg.root!r}: {folder} is not a readable ImageFolder (no "
                                      f"class folders: {folder}/<class>/*.JPEG): fix the path, {leave_out}")
    for field_name in ("urls", "train_urls", "val_urls"):
        urls = eval_cfg.get(field_name)
        if urls:
            check_local_shards(str(urls), f"{key}.{field_name}", leave_out)


def check_local_shards(urls: str, key: str, fix: str) -> None:
    """Each local pattern of ``urls`` (``::``-joined, brace-expanded) matches a file; streams (``pipe:``,
    ``scheme://``) are read when the set is."""
    import glob

    import braceexpand

    for pattern in urls.split("::"):
        for url in braceexpand.braceexpand(pattern):
            if "://" in url or url.startswith("pipe:"):
                continue
            if not glob.glob(os.path.expanduser(url)):
                raise ConfigError(f"{key}={urls!r}: {url!r} matches no file: fix the pattern, {fix}")


def embedded_digits(eval_cfg: DictConfig) -> bool:
    """A set of the digits (``eval.<name>.classnames=digits``, or ``eval=digits``) without shards of its own reads
    the embedded digits' splits."""
    return eval_cfg.name == "digits" or eval_cfg.classnames == "digits"


def check_probe(eval_cfg: DictConfig) -> None:
    key = f"eval.{eval_cfg.name}"
    if eval_cfg.fewshot is not None:
        at_least(eval_cfg.fewshot, f"{key}.fewshot", 1, "5 (images a class), or null for all")
    if not 0 <= eval_cfg.val_proportion < 1:
        raise ConfigError(f"{key}.val_proportion={eval_cfg.val_proportion}: the share of the training split held "
                          "out for the weight-decay search, in [0, 1), e.g. 0.2 (0: no search)")
    if eval_cfg.probe_lr <= 0:
        raise ConfigError(f"{key}.probe_lr={eval_cfg.probe_lr} must be positive, e.g. 0.1")
    at_least(eval_cfg.probe_epochs, f"{key}.probe_epochs", 1, "10")
    at_least(eval_cfg.probe_batch_size, f"{key}.probe_batch_size", 1, "64")
    if eval_cfg.task == "dense_probe":
        at_least(eval_cfg.get("mosaic", 2), f"{key}.mosaic", 1, "2 (images a side of a scene)")
        if eval_cfg.fewshot is not None:  # its rows are patches, not images: k of them a class means nothing here
            raise ConfigError(f"{key}.fewshot={eval_cfg.fewshot}: the dense probe trains on every training scene; "
                              f"leave {key}.fewshot unset (null)")
    if eval_cfg.format not in ("wds", "folder", "clip_benchmark"):
        raise ConfigError(f"{key}.task={eval_cfg.task} reads format=clip_benchmark, folder or wds, not "
                          f"{eval_cfg.format}")
    if eval_cfg.format == "wds" and not embedded_digits(eval_cfg) and not (eval_cfg.urls and eval_cfg.train_urls):
        raise ConfigError(f"{key}.task={eval_cfg.task} needs {key}.train_urls and {key}.urls (the training and test "
                          "splits' shards: cls + image)")


def eval_root(eval_cfg) -> str:
    """``eval.<name>.root`` of a folder-format evaluation set (its config, or its ``EvalSetSettings``), which must be
    given."""
    missing = isinstance(eval_cfg, DictConfig) and OmegaConf.is_missing(eval_cfg, "root")
    if missing or not eval_cfg.root:
        what = {"objectnet": "the ObjectNet release folder",
                "clip_benchmark": "a CLIP_benchmark dataset folder: test/nshards.txt, test/0.tar, ..., classnames.txt"
                }.get(eval_cfg.format, "an ImageFolder path")
        raise ConfigError(f"eval.{eval_cfg.name}.root is not set for eval={eval_cfg.name} ({what}), e.g. "
                          f"eval.{eval_cfg.name}.root=/data/{eval_cfg.name}; or eval=none")
    return eval_cfg.root


def check_optim(optim: DictConfig) -> None:
    if optim.lr <= 0:
        raise ConfigError(f"optim.lr={optim.lr} must be positive, e.g. optim.lr=5e-4")
    at_least(optim.weight_decay, "optim.weight_decay", 0, "0.2")
    if optim.grad_clip is not None and optim.grad_clip <= 0:
        raise ConfigError(f"optim.grad_clip={optim.grad_clip}: give a positive max norm, e.g. "
                          "optim.grad_clip=1.0, or null for no clipping")
    choice(optim.lr_scaling, "optim.lr_scaling", (None, "none", "linear", "sqrt"))
    if optim.lr_scaling not in (None, "none"):
        parse_count(optim.base_batch, "optim.base_batch")
    check_layer_decay(optim.get("layer_decay"))
    if str(optim.optimizer.get("_target_", "")).endswith("timm_optimizer") and not optim.get("name"):
        raise ConfigError("optim=timm needs optim.name: timm's name of the optimizer, e.g. optim.name=lamb")


def check_layer_decay(decay) -> None:
    """``optim.layer_decay``: null, one number for both towers, or ``{image: ..., text: ...}``, each in (0, 1]."""
    fix = "e.g. optim.layer_decay.image=0.75 optim.layer_decay.text=0.65, or null (off)"
    if decay is None or isinstance(decay, (int, float)) and not isinstance(decay, bool):
        per_tower = {"both towers": decay}
    elif isinstance(decay, DictConfig):
        unknown = set(decay) - {"image", "text"}
        if unknown:
            raise ConfigError(f"optim.layer_decay has {sorted(unknown)}: it takes image and text; {fix}")
        per_tower = {f"optim.layer_decay.{tower}": decay.get(tower) for tower in ("image", "text")}
    else:
        raise ConfigError(f"optim.layer_decay={decay!r}: {fix}")
    for key, value in per_tower.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= 1):
            raise ConfigError(f"{key}={value!r}: a decay per layer in (0, 1]; {fix}")


def check_ema(ema: DictConfig | None, eval_sets: DictConfig, trainer: DictConfig) -> None:
    """``ema.*`` (absent in a config stored before it existed: off), and ``eval.<name>.weights=ema``
    only where there is an average."""
    decay = None
    if ema is not None:
        check_known_keys(ema, EmaConfig, "ema")
        decay, every, power = ema.get("decay"), ema.get("every", 1), ema.get("warmup_power")
        if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1):
            raise ConfigError(f"ema.decay={decay!r}: give the average's decay per update in (0, 1), e.g. "
                              "ema.decay=0.9999, or null (off)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"ema.every={every!r}: give the optimizer steps between updates of the average, e.g. 1")
        if power is not None and (isinstance(power, bool) or not isinstance(power, (int, float)) or power <= 0):
            raise ConfigError(f"ema.warmup_power={power!r}: give a power > 0 (timm's 2/3; 3/4 for long runs), "
                              "or null (no warm-up)")
    for name in eval_sets:
        weights = eval_sets[name].weights
        if weights in ("ema", "both") and decay is None:
            raise ConfigError(f"eval.{name}.weights={weights} but the run keeps no moving average: set ema.decay "
                              f"(e.g. 0.9999) or eval.{name}.weights=raw")


def check_self_distill(node: DictConfig | None, model: DictConfig) -> None:
    """``self_distill.*`` (absent in a config stored before it existed: off): its numbers, each a ``ConfigError``
    naming the key and a value that works; on, a trained image tower that encodes its images."""
    if node is None:
        return
    check_known_keys(node, SelfDistillConfig, "self_distill")
    values = {**vars(SelfDistillConfig()), **{key: node[key] for key in node}}

    def number(key: str, low: float, high: float, example: str, low_open: bool = False,
               high_open: bool = False, whole: bool = False) -> None:
        value = values[key]
        kind = int if whole else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or value < low or value > high \
                or (low_open and value == low) or (high_open and value == high):
            raise ConfigError(f"self_distill.{key}={value!r}: give {example}")

    number("weight", 0, float("inf"), "the local-to-global term's weight >= 0 (SigLIP 2: 1.0; 0: off)")
    number("masked_weight", 0, float("inf"), "the masked-prediction term's weight >= 0 (SigLIP 2: 0.25; 0: off)")
    if values["weight"] == 0 and values["masked_weight"] == 0:
        return
    number("start", 0, 1, "the share of training done before the terms start, in [0, 1) (SigLIP 2: 0.8)",
           high_open=True)
    number("local_crops", 1, 64, "the student's crops per image, e.g. 8 (SigLIP 2)", whole=True)
    number("local_size", 1, 4096, "the crops' side in pixels, a multiple of the patch size, e.g. 96", whole=True)
    number("mask_ratio", 0, 1, "the share of patch tokens masked, in (0, 1) (SigLIP 2: 0.5)", low_open=True,
           high_open=True)
    number("prototypes", 2, 1 << 20, "the heads' prototypes, e.g. 4096", whole=True)
    number("hidden", 1, 1 << 16, "the heads' hidden width, e.g. 2048", whole=True)
    number("bottleneck", 1, 1 << 16, "the heads' bottleneck width, e.g. 256", whole=True)
    number("student_temp", 0, 10, "the student's softmax temperature > 0, e.g. 0.1", low_open=True)
    number("teacher_temp", 0, 10, "the teacher's softmax temperature > 0, e.g. 0.04", low_open=True)
    number("center_momentum", 0, 1, "the center's momentum in [0, 1), e.g. 0.9", high_open=True)
    number("teacher_momentum", 0, 1, "the EMA teacher's momentum per step in [0, 1), e.g. 0.996", high_open=True)
    scale = list(values["crop_scale"])
    if len(scale) != 2 or not all(isinstance(v, (int, float)) for v in scale) or not 0 < scale[0] < scale[1] <= 1:
        raise ConfigError(f"self_distill.crop_scale={scale}: give [low, high] shares of the image's area, "
                          "0 < low < high <= 1, e.g. [0.05,0.4]")
    settings = model_settings(model)
    if model.get("lock_image") or settings.image_features == "stored":
        why = "locked (model.lock_image=true)" if model.get("lock_image") else \
            "read from the shards (model.image_features=stored)"
        raise ConfigError(f"self_distill trains the image tower on views of the images, and this run's image tower is "
                          f"{why}: set self_distill.weight=0 and self_distill.masked_weight=0")


def check_distill(distill: DictConfig | None, loss: DictConfig, train: DictConfig) -> None:
    """``distill.*`` (absent in a config stored before it existed: off): its numbers, a softmax loss, and
    ``data.train.teacher_key`` exactly with stored embeddings."""
    stored = distill is not None and distill.get("teacher") == "stored"
    key = train.get("teacher_key")
    if stored and not key:
        raise ConfigError("distill.teacher=stored reads each sample's teacher embeddings from the shards: set "
                          "data.train.teacher_key (e.g. teacher.npy, as scripts/make_shards.py teacher writes it)")
    if key and not stored:
        raise ConfigError(f"data.train.teacher_key={key} is read only with distill.teacher=stored: set "
                          "distill.teacher=stored, or data.train.teacher_key=null")
    if distill is None:
        return
    check_known_keys(distill, DistillConfig, "distill")
    weight, temperature = distill.get("weight", 1.0), distill.get("temperature")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise ConfigError(f"distill.weight={weight!r}: give the distillation term's weight beside the contrastive "
                          "loss's, a number >= 0, e.g. distill.weight=1.0")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or temperature <= 0):
        raise ConfigError(f"distill.temperature={temperature!r}: give the teacher's softmax temperature > 0 (its "
                          "logits are divided by it), e.g. 0.01, or null (the teacher's own: 1 / its logit scale)")
    compiled = distill.get("compile")
    if compiled is not None and not isinstance(compiled, bool):
        raise ConfigError(f"distill.compile={compiled!r}: true (torch.compile the teacher's encoders), false, or null "
                          "(as model.compile)")
    if distill.get("teacher") is None:
        if distill.get("pretrained") is not None:
            raise ConfigError(f"distill.pretrained={distill.pretrained!r} without distill.teacher: name the teacher's "
                              "architecture too, e.g. distill.teacher=ViT-L-14")
        return
    if stored and distill.get("pretrained") is not None:
        raise ConfigError(f"distill.pretrained={distill.pretrained!r} with distill.teacher=stored: stored embeddings "
                          "need no teacher weights; drop distill.pretrained")
    if str(loss.get("_target_", "")).endswith("SigLipLoss"):
        raise ConfigError("distill.teacher with loss=siglip: distillation runs with a softmax loss (loss=infcl, local, "
                          "disco or vanilla). A sigmoid term (cross-entropy against the teacher's sigmoid "
                          "probabilities) needs a sigmoid teacher's logit bias, which neither a CLIP teacher nor the "
                          "stored embeddings carry: without it every pair's target is ~1")


def check_image_features(cfg: DictConfig) -> None:
    """``model.image_features=stored`` (LiT from stored features) with ``data.train.image_features_key``, and only
    where no part of the run needs the images themselves: a locked image tower (its trained layers, a CoCa's
    decoder and an online teacher read pixels), nothing to decode on the GPU."""
    mode = cfg.model.get("image_features", "tower")
    key = cfg.data.train.get("image_features_key")
    if mode not in ("tower", "stored"):
        raise ConfigError(f"model.image_features={mode!r}: give tower (the image tower encodes each image) or stored "
                          "(its features read from the shards, data.train.image_features_key; a locked tower)")
    if mode == "tower":
        if key:
            raise ConfigError(f"data.train.image_features_key={key} is read only with model.image_features=stored: set "
                              "model.image_features=stored, or data.train.image_features_key=null")
        return
    if not key:
        raise ConfigError("model.image_features=stored reads each sample's image features from the shards: set "
                          "data.train.image_features_key (e.g. image.npy, as scripts/make_shards.py image-features "
                          "writes it)")
    if not cfg.model.get("lock_image", False) or int(cfg.model.image.get("unlocked_layers", 0) or 0) > 0:
        raise ConfigError("model.image_features=stored stands for a locked image tower's features: set "
                          "model.lock_image=true (and model.image.unlocked_layers=0), or model.image_features=tower")
    if loss_weights(cfg.loss)[0] > 0:
        raise ConfigError(f"loss.caption_weight={loss_weights(cfg.loss)[0]} with model.image_features=stored: the "
                          "caption decoder reads the image tower's tokens, which stored features do not keep; set "
                          "loss.caption_weight=0 or model.image_features=tower")
    teacher = (cfg.get("distill") or {}).get("teacher")
    if teacher is not None and teacher != "stored":
        raise ConfigError(f"distill.teacher={teacher} with model.image_features=stored: an online teacher encodes the "
                          "images, which a run on stored features never reads; store the teacher's embeddings too "
                          "(scripts/make_shards.py teacher, distill.teacher=stored) or set model.image_features=tower")
    if cfg.data.get("decode") == "gpu":
        raise ConfigError("data.decode=gpu with model.image_features=stored: no image is decoded (each sample's "
                          "stored features are read instead); set data.decode=auto")


def check_schedule(sched: DictConfig) -> None:
    """The numbers a schedule option may take (options differ in which keys they have)."""
    for key in ("warmup_steps", "decay_steps"):
        value = sched.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"sched.{key}={value!r} must be a whole number of steps >= 0 (or null)")
    for key in ("warmup_samples", "decay_samples"):
        parse_optional_count(sched.get(key), f"sched.{key}")
    ratio = sched.get("min_lr_ratio")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
        raise ConfigError(f"sched.min_lr_ratio={ratio!r} must lie in [0, 1], e.g. 0.0")


def check_buildable(node: DictConfig, key: str, **kwargs) -> None:
    """Build a cheap ``_target_`` (a loss, a schedule) once: its constructor checks its own
    arguments, and an error surfaces now, naming ``key``, not after the model and data are built."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__ or error
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"{key}: {cause}") from None


def runs_on_cuda(device: str) -> bool:
    """Whether ``trainer.device`` puts the run on a CUDA GPU (``auto``: where there is one)."""
    device = str(device)
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


LOSS_WEIGHTS = {"caption_weight": 0.0, "contrastive_weight": 1.0}  # applied by the step (losses/base.py keeps them)


def loss_weights(loss: DictConfig) -> tuple[float, float]:
    """``(loss.caption_weight, loss.contrastive_weight)`` (absent in a config stored before them: 0, 1)."""
    return tuple(float(loss.get(key, default)) for key, default in LOSS_WEIGHTS.items())


def caption_warmup(loss: DictConfig) -> float:
    """``loss.caption_warmup``: the share of the run's steps over which the caption term's weight rises from 0 to
    ``loss.caption_weight`` (absent in a config stored before it: 0, the whole weight from the first step)."""
    return float(loss.get("caption_warmup", 0.0))


def check_loss(loss: DictConfig, device: str) -> None:
    """The loss's own arguments (its constructor), its weights, and ``impl=triton`` only where a GPU (or
    the interpreter, for tests) will run it."""
    for key in LOSS_WEIGHTS:
        value = loss.get(key, LOSS_WEIGHTS[key])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"loss.{key}={value!r}: give a weight >= 0, e.g. loss.{key}={LOSS_WEIGHTS[key] or 1.0}")
    warmup = loss.get("caption_warmup", 0.0)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup <= 1:
        raise ConfigError(f"loss.caption_warmup={warmup!r}: give a share of the run's steps in [0, 1] (the caption "
                          "term's weight rises from 0 over it), e.g. loss.caption_warmup=0.2, or 0 for none")
    if warmup > 0 and loss_weights(loss)[0] == 0:
        raise ConfigError(f"loss.caption_warmup={warmup} with loss.caption_weight=0: there is no caption term to warm "
                          "up; set loss.caption_weight > 0 (e.g. 1.0) or loss.caption_warmup=0")
    check_buildable(loss, "loss")
    if loss.get("impl") == "triton":
        if not runs_on_cuda(device) and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ConfigError("loss.impl=triton needs a CUDA GPU and this run is on the CPU; use "
                              "loss.impl=auto (Triton on CUDA, torch elsewhere) or loss.impl=torch")


def check_logit_bias(loss: DictConfig, model: DictConfig) -> None:
    """A sigmoid loss needs the model's learnable logit bias; a softmax loss has no use for one."""
    from hydra.utils import get_class

    uses_bias = getattr(get_class(loss._target_), "uses_bias", False)
    has_bias = model.get("init_logit_bias") is not None
    if uses_bias and not has_bias and "arch" not in model:  # an open_clip architecture may have its own
        raise ConfigError(f"{loss._target_.rsplit('.', 1)[-1]} needs a logit bias: set model.init_logit_bias "
                          "(SigLIP's is -10; loss=siglip sets it unless overridden with null)")
    if has_bias and not uses_bias:
        raise ConfigError(f"model.init_logit_bias={model.init_logit_bias} but {loss._target_.rsplit('.', 1)[-1]} "
                          "takes no bias; use loss=siglip or model.init_logit_bias=null")


# model.* options removed after their measurements (a checkpoint's stored config may still hold them)
RETIRED_MODEL_KEYS = {
    "fused_mlp": "the fused MLP kernels measured slower than cuBLAS + inductor in whole towers",
    "fused_layernorm": "the fused residual add + LayerNorm kernels gave no gain in whole towers",
}


@dataclass(frozen=True)
class ModelSettings:
    """The ``model.*`` keys a run applies to the built model, typed (the model group's other keys are
    its builder's, which differ per option). ``train.yaml``'s ``model:`` section gives every run all
    of them; a key absent from a config (one a checkpoint stored before the key existed) takes the
    value it had then, below: off, ``auto``, ``erf``. Read them through ``model_settings``."""

    compile: bool = False
    compile_scope: str = "auto"   # auto | block | tower
    cuda_graphs: bool = False
    trim_text: bool = False
    direct_attention: bool = False
    attention: str = "auto"       # auto | sdpa | triton
    patch_gemm: bool = False
    gelu: str = "erf"             # erf | tanh
    fp8: bool = False
    image_features: str = "tower"  # tower | stored (data.train.image_features_key)


def model_settings(model: DictConfig) -> ModelSettings:
    """``model``'s run settings, typed, absent ones as ``ModelSettings`` says; a flag that is not a
    boolean is a ``ConfigError`` naming it."""
    values = {spec.name: model[spec.name] for spec in fields(ModelSettings) if spec.name in model}
    for spec in fields(ModelSettings):
        if spec.type == "bool" and spec.name in values and not isinstance(values[spec.name], bool):
            raise ConfigError(f"model.{spec.name}={values[spec.name]!r}: give true or false")
    return ModelSettings(**values)


def check_model(model: DictConfig) -> None:
    """What can be checked of the model before it is built: its run settings (``ModelSettings``)
    and the sizes a built-in shape gives. The towers' own fields are open_clip's, checked by the
    builders with errors naming ``model.image`` / ``model.text``; an open_clip architecture's sizes
    are its own."""
    for key, measured in RETIRED_MODEL_KEYS.items():
        if model.get(key, False):  # false: an older run's stored config, harmless
            raise ConfigError(f"model.{key} is gone: {measured} (docs/performance.md); remove the override")
    settings = model_settings(model)
    gelu = settings.gelu
    if gelu not in ("erf", "tanh"):
        raise ConfigError(f"model.gelu={gelu!r}: give erf (the exact GELU, open_clip's) or tanh (its tanh "
                          "approximation, cuBLASLt's GEMM epilogue; not exact)")
    attention = settings.attention
    if attention not in ("auto", "sdpa", "triton"):
        raise ConfigError(f"model.attention={attention!r}: give auto (per call, from the kernels' measured table), "
                          "sdpa (PyTorch's scaled_dot_product_attention) or triton (the project's kernels on the "
                          "packed projection)")
    if attention == "triton" and not settings.direct_attention:
        raise ConfigError("model.attention=triton runs in the blocks that model.direct_attention makes: set "
                          "model.direct_attention=true (or model.attention=sdpa)")
    # auto without direct_attention: nn.MultiheadAttention's own SDPA, nothing to choose
    scope = settings.compile_scope
    if scope not in ("auto", "block", "tower"):
        raise ConfigError(f"model.compile_scope={scope!r}: give block (each transformer block compiled once for all "
                          "layers), tower (each tower whole) or auto")
    if scope == "block" and settings.cuda_graphs:
        raise ConfigError("model.cuda_graphs=true records each tower whole as CUDA graphs: use "
                          "model.compile_scope=tower or auto with it")
    if settings.cuda_graphs and not settings.compile:
        raise ConfigError("model.cuda_graphs=true replays the compiled towers as CUDA graphs: set model.compile=true "
                          "too (or model.cuda_graphs=false)")
    size = model.image.get("image_size", 224)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"model.image.image_size={size!r} must be a positive number of pixels, e.g. 224")
    context = model.text.get("context_length", 77)
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise ConfigError(f"model.text.context_length={context!r} must be a positive number of tokens, e.g. 77")
    preprocess = model.get("preprocess") or {}
    unknown = sorted(set(preprocess) - set(PREPROCESS_KEYS))
    if unknown:
        raise ConfigError(f"model.preprocess: unknown option(s) {unknown}; the options are "
                          f"{', '.join(PREPROCESS_KEYS)} "
                          "(the image size is the model's: model.image.image_size)")
    for key, options in (("interpolation", INTERPOLATIONS), ("resize_mode", RESIZE_MODES)):
        if preprocess.get(key) is not None:
            choice(preprocess[key], f"model.preprocess.{key}", options)
