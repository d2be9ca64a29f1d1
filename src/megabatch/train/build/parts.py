"""What one rank of a run trains with, built from a validated config: the model and its tokenizer,
the data and the batch plan, the optimizer and the schedule, the offload owner, the sub-batch
stream and the step. No run directory, checkpoints or logs: those are the ``Trainer``'s.

    parts = RunParts.build(validate(compose("trainer.sub_batch=16")), init_distributed("cpu"))
    loss, times = parts.step.gradients(parts.inputs(0))
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig

from ...config import ConfigError
from ...config.run import DataSettings, EmaSettings, RunSettings
from ...config.schema import ModelSettings
from ...data import TrainData
from ...data.gpu_decode import KEPT_HARDWARE_FILE, GpuDecoder, resolve_decode
from ...data.naflex import NaFlexSpec
from ...data.offload import Offload
from ...data.samples import SubBatch
from ...data.worker_start import resolve_worker_start
from ...distributed import DistEnv
from ...distributed.fsdp import local, shard_model
from ...models import ClipModel, build_model
from ...models.fp8 import convert_to_fp8
from ...models.preprocess import describe_preprocess
from ...models.views import ViewsCfg
from ...runtime.files import replace_json
from ...runtime.process import compiler_imports
from ..step.ema import WeightAverage
from ..step.objectives import build as build_objectives
from ..step.objectives.self_distill import start_step
from ..step.plan import BatchPlan, rank_batch_of
from ..step.precision import Precision
from ..step.step import TrainStep
from ..step.utilization import ModelFlops, Peak, count_model_flops, gpu_peak
from .cache_keys import keyed_file
from .compile_cache import CompileCache, cache_file, compile_timers, describe_split
from .inputs import RunInputs, read_ahead_budget
from .memory_plan import (
    LengthFits,
    MemoryFit,
    ProbeCache,
    SubBatchChoice,
    batch_bytes,
    graphs_in,
    kept_measurements,
    plan_sub_batch_and_reduction,
    probe_key,
    probe_peak_memory,
    teacher_bytes,
)
from .optim import build_optimizer, describe_param_groups
from .startup import StartupTimes

log = logging.getLogger("megabatch")


@dataclass
class RunParts:
    model: ClipModel
    tokenize: Callable
    data: TrainData
    plan: BatchPlan
    optimizer: torch.optim.Optimizer
    peak_lr: float
    schedule: Callable[[int], float]   # step -> multiplier of peak_lr
    offload: Offload | None
    inputs: RunInputs
    step: TrainStep
    flops: ModelFlops                  # model FLOPs per sample (utilization.py)
    peak: Peak | None                  # the GPU's dense bf16 peak
    settings: RunSettings              # the config's counts and choices, parsed once (config/run.py)
    compilation: Compilation | None = None  # model.compile: the towers' warm-up (warm_up), once
    reading: Iterator[SubBatch] | None = None  # build's read_from: the sub-batches from there, already being read

    @classmethod
    def build(cls, cfg: DictConfig, env: DistEnv, *, warm_up: bool = True,
              times: StartupTimes | None = None, read_from: int | None = None) -> RunParts:
        """Build every part for ``env``'s rank, after ``configure_backends`` (megabatch/runtime/process.py) has made
        the process-wide settings: the model, then the data it reads, the batch plan the data and the
        GPU's memory allow, then the step (``build_step``, as the benchmarks build it). ``warm_up=False``:
        the towers are compiled later, by ``warm_up()`` (the trainer's, once the loader's workers are
        reading). ``times``: each part's seconds go there (the start-up's account). ``read_from`` (the trainer's: 0, or
        the step the run resumes at): the loader starts reading from there as soon as the batch plan is known, before
        the step is built and the towers compile, and ``reading`` holds its sub-batches (what ``inputs(read_from)``
        would return later)."""
        phase = (times if times is not None else StartupTimes()).phase  # timing is cheap; unasked, it is dropped
        settings = RunSettings.of(cfg)  # every count and choice parsed once, handed down
        with phase("model"):
            with compiling_ahead(cfg, settings, env):
                model = build_model_for(cfg, settings, env)
            tokenize = model.tokenizer()  # the model's own, as its image size and preprocessing below
        if env.rank == 0:
            log.info("model %s: preprocessing %s", model.name, describe_preprocess(model.preprocess))
        with phase("data"):
            data = TrainData(settings.data, tokenize, model.preprocess, settings.seed, show_progress=env.rank == 0,
                             worker_start=resolve_worker_start(settings.data, env.device.type), naflex=model.naflex,
                             global_batch=settings.batch)
            check_stored_image_features(model, data, env)
            precision = precision_of(settings, env)
            check_naflex(model, settings)
            if model.naflex is not None:  # the lengths it is measured and compiled at
                model.image_lengths = data.transform.seq_lens
            # a NaFlex tower's images decode on the GPU where data.decode=gpu says so (auto: the loader workers)
            gpu_decoder, ahead = build_gpu_decoder(settings.data, env) if data.image_features is None and (
                model.naflex is None or settings.data.decode == "gpu") else (None, 0.0)
        with phase("flop count"):  # FLOPs per sample, counted on the whole model, eagerly (before FP8 and sharding)
            flops, peak = model_flops(cfg, settings, model, env), gpu_peak(env.device)
        if env.rank == 0:
            log_utilization_basis(flops, peak, gpu_decoder is not None, ahead)
        with phase("plan"):
            loss = prepare_model(cfg, settings, model, env, precision, data)
            # trainer.sub_batch=auto measures the model as it trains: FP8, and each rank's shard under FSDP
            auto = choose_sub_batch(settings, model, env, precision, ahead, getattr(loss, "teacher", None),
                                    join_lengths=model.naflex is not None and data.split != "shard",
                                    probe_cache=ProbeCache.for_run(cfg, env.rank, env.world_size, env.device))
            plan = plan_batches(settings, env.world_size, data, auto.sub_batch if auto else None,
                                auto.token_budget if auto else None)
            if plan.token_budget is not None and env.rank == 0:
                log.info("a token budget of %d patches (trainer.sub_batch_tokens, or trainer.sub_batch=auto's): a "
                         "sub-batch of %s (the loader's of the longest joined for the shorter)", plan.token_budget,
                         ", ".join(
                             f"{rows} images at {length} patches" for length, rows in
                             sorted(plan.rows_at(model.image_lengths).items())))
            offload = build_offload(cfg, settings, model, data, env.rank, gpu_decoder)
            inputs = RunInputs(data, plan, env.rank, keep_raw=offload is not None,
                               pin_memory=env.device.type == "cuda",
                               read_ahead_bytes=read_ahead_budget(settings.trainer.prefetch_gb,
                                                                  settings.trainer.offload, gpu_decoder is not None),
                               gpu_decoder=gpu_decoder, decode_ahead_bytes=ahead,
                               read_ahead_auto=settings.trainer.prefetch_gb == "auto")
            if env.rank == 0:
                log.info("data: %s", inputs.describe_read_ahead())
        reading = None
        try:
            if read_from is not None:  # the workers read while the step is built and the towers compile
                with phase("loader start"):  # (the loader draws from its own generator: no training randomness)
                    reading = inputs(read_from)
            with phase("step"):
                built = build_step(cfg, env, model, loss, plan, precision, offload, warm_up=False, auto=auto,
                                   settings=settings)
                schedule = instantiate(cfg.sched, total_steps=plan.total_steps, global_batch=plan.global_batch,
                                       steps_per_epoch=plan.steps_per_epoch)
        except BaseException:  # a failed build leaves no workers, spill file or decoding thread behind
            if reading is not None:
                reading.close()
            close_inputs(inputs, offload)
            raise
        seed_rank(settings, env)
        parts = cls(model, tokenize, data, plan, built.optimizer, built.peak_lr, schedule, offload, inputs, built.step,
                    flops, peak, settings, built.compilation, reading)
        if warm_up:
            parts.warm_up()
        return parts

    @property
    def compile_s(self) -> float:
        """Seconds the towers took to compile (``model.compile``; 0 before ``warm_up`` or without it)."""
        return self.compilation.seconds if self.compilation is not None else 0.0

    def warm_up(self) -> float:
        """With ``model.compile``: compile every graph training calls now (once; ``Compilation.run``).
        Returns the seconds it took."""
        return self.compilation.run() if self.compilation is not None else 0.0

    def close(self) -> None:
        """Stop the loaders' workers, the offload's re-decode workers (its spill file deleted) and the GPU
        decoding threads."""
        if self.reading is not None:
            self.reading.close()
        close_inputs(self.inputs, self.offload)


def close_inputs(inputs: RunInputs, offload: Offload | None) -> None:
    """Stop ``inputs``' loader workers and GPU decoding threads and ``offload``'s re-decode workers (its spill file
    deleted)."""
    inputs.close()
    if offload is not None:
        offload.close()
    if inputs.gpu_decoder is not None:
        inputs.gpu_decoder.close()


def check_naflex(model: ClipModel, settings: RunSettings) -> None:
    """A NaFlex image tower (``model.image.naflex``) with what it cannot train with yet: a ``ConfigError`` naming
    the key and the fix. ``self_distill``'s crops and masked view read an open_clip ViT's grid."""
    if model.naflex is None:
        return
    if model.views is not None:
        raise ConfigError("self_distill with a NaFlex image tower (model.image.naflex=true): its crops and masked "
                          "view are cut from a fixed-size ViT's grid; set self_distill.weight=0 and "
                          "self_distill.masked_weight=0, or a fixed-size model")


# what build_clip imports while it builds (models/clip.py: build_model); nothing else for its CLIPs, CoCas and NaFlex
# towers without a Hugging Face text tower (a test: tests/train/test_compile.py)
BUILD_CLIP_IMPORTS = ("megabatch.models.attention", "megabatch.models.mlp", "megabatch.models.patches",
                      "megabatch.models.decoder")


def compiling_ahead(cfg: DictConfig, settings: RunSettings, env: DistEnv):
    """``model.compile``: the model's build with what the first compilation imports imported beside it, and Triton's
    library hashed beside it on CUDA (``runtime/process.py: compiler_imports``). The imports only where the build
    imports nothing that they might (``BUILD_CLIP_IMPORTS``, imported first: a ``build_clip`` model without a Hugging
    Face text tower), so that no module is imported by both threads at once."""
    compiled = settings.model.compile
    imports = compiled and cfg.model.get("_target_") == "megabatch.models.build_clip" and \
        not (cfg.model.get("text") or {}).get("hf_path")
    if imports:
        for name in BUILD_CLIP_IMPORTS:
            importlib.import_module(name)
    return compiler_imports(imports, hash_triton=compiled and env.device.type == "cuda")


def build_model_for(cfg: DictConfig, settings: RunSettings, env: DistEnv) -> ClipModel:
    """``cfg.model`` on ``env``'s device in training mode, from weights seeded with ``seed``
    (the same on every rank). Frozen towers stay in eval mode; a Hugging Face tower, which
    transformers loads in eval mode, trains with its dropout on."""
    torch.manual_seed(settings.seed)
    model = build_model(cfg.model)
    if settings.self_distill.on:  # self_distill's heads over the student's views (models/views.py)
        model.attach_views(ViewsCfg.of(settings.self_distill.views))
    return model.to(env.device).train()


def check_stored_image_features(model: ClipModel, data: TrainData, env: DistEnv) -> None:
    """``model.image_features=stored``: the features ``data`` reads must be this model's locked image tower's
    (``ImageFeatureSpec.check``: its weights, width and preprocessing); said once where they are."""
    spec = data.image_features
    if spec is None:
        return
    folder = os.path.dirname(data.urls[0]) or "."
    spec.check(model, folder)
    if env.rank == 0:
        log.info("model.image_features=stored: the locked image tower %s is not run in training; each sample's "
                 "stored features (%s, width %d, the centre crop at %dx%d px: no augmentation) are read from the "
                 "shards in %s instead. Evaluation encodes images with the tower", model.name, spec.key, spec.width,
                 *spec.size, folder)


def prepare_model(cfg: DictConfig, settings: RunSettings, model: ClipModel, env: DistEnv, precision: Precision,
                  data: TrainData | None = None):
    """The model as it trains, and its loss: the loss's logit bias checked against the model's,
    the Linear layers in FP8 (``model.fp8``), the weights sharded (``trainer.parallel=fsdp``);
    before the optimizer takes the parameters. Returns the loss."""
    loss = instantiate(cfg.loss)
    check_bias(model, loss)
    train_decoder(settings, model, env)
    loss = distilled(cfg, settings, loss, model, env, data)
    if settings.model.fp8:
        converted = convert_to_fp8(model, env.device)
        if env.rank == 0:
            log.info("model.fp8: %d Linear layers train in FP8 (torchao)%s", converted, "" if settings.model.compile
                     else "; without model.compile the casts cost more than FP8 saves: set model.compile=true")
    shard(settings, model, env, precision)
    return loss


def train_decoder(settings: RunSettings, model: ClipModel, env: DistEnv) -> None:
    """``loss.caption_weight > 0``: the model's caption decoder (a CoCa's) trains beside the towers; a model
    without one is a config error naming the key."""
    caption, contrastive = settings.caption_weight, settings.contrastive_weight
    if caption <= 0:
        return
    if not model.has_decoder:
        raise ConfigError(f"loss.caption_weight={caption} but model {model.name} has no caption decoder: give it one "
                          "(model.decoder.layers=2), train a CoCa (model=openclip model.arch=coca_ViT-B-32, or "
                          "model=tiny_coca), or loss.caption_weight=0")
    decoder = model.decoder_module
    decoder.requires_grad_(True)
    if env.rank == 0:
        log.info("loss: %s x contrastive + %s x caption (the %s decoder's cross-entropy over the global batch's "
                 "caption tokens, in GradCache's replay); the decoder trains (%.1fM parameters)", contrastive,
                 caption, "CoCa" if model.decoder is None else "model.decoder",
                 sum(p.numel() for p in decoder.parameters()) / 1e6)


def distilled(cfg: DictConfig, settings: RunSettings, loss, model: ClipModel, env: DistEnv,
              data: TrainData | None = None):
    """``loss``, or with ``distill.teacher`` the loss plus the distillation term (``DistilledLoss``),
    holding the frozen teacher it is computed against (or with ``stored`` the embeddings ``data``
    reads); the teacher's cost logged once."""
    distill = settings.distill
    if distill.teacher is None:
        return loss
    from ...losses.distill import DistilledLoss
    from ..step.teacher import build_teacher

    compiled = settings.model.compile if distill.compile is None else distill.compile
    teacher = build_teacher(distill, model, env.device, None if data is None else data.teacher, compiled,
                            shard=settings.trainer.parallel == "fsdp" and env.distributed)
    if env.rank == 0 and teacher.model is None:
        spec = teacher.spec
        log.info("distill: stored teacher embeddings (%s: %s, width %d, logit scale(s) %s), weight %s: the loss is "
                 "the contrastive term plus the distillation term (OpenCLIP's DistillClipLoss%s)",
                 spec.key, ", ".join(spec.teachers) or f"{spec.members} member(s)", spec.width, teacher.scale,
                 distill.weight, "; the ensemble's target the mean of its members' probabilities"
                 if spec.members > 1 else "")
    elif env.rank == 0:
        params = sum(p.numel() for p in teacher.model.parameters())
        log.info("distill: teacher %s (%.0fM parameters, frozen, %s%s; width %d, logit scale %.2f), weight %s: the "
                 "loss is the contrastive term plus the distillation term (OpenCLIP's DistillClipLoss)",
                 teacher.model.name, params / 1e6, next(teacher.model.parameters()).dtype,
                 ", compiled" if teacher.compiled else ", sharded over the ranks" if teacher.sharded else "",
                 teacher.width, teacher.scale, distill.weight)
    return DistilledLoss(loss, distill.weight, teacher.scale, teacher)


class BuiltStep(NamedTuple):
    step: TrainStep
    optimizer: torch.optim.Optimizer
    peak_lr: float
    compilation: Compilation | None  # model.compile: the towers' warm-up, run or still to run


class Compilation:
    """``model.compile``'s towers, wrapped for compilation (``ClipModel.compile_towers``), and
    ``run``, which compiles every graph training calls (``ClipModel.warm_up``) between loading and
    saving the compile cache (``compile_cache.py``). ``seconds``: how long ``run`` took (0 before)."""

    def __init__(self, cfg: DictConfig, env: DistEnv, model: ClipModel, plan: BatchPlan, precision: Precision,
                 settings: ModelSettings, options: dict | None = None):
        self.cfg, self.env, self.model, self.plan, self.precision = cfg, env, model, plan, precision
        self.options = options or {}  # the model's forward options the objectives will ask for (warm_up's)
        check_exact_replay(model, plan)
        self.scope = compile_scope(settings)
        # a token budget's sub-batches of shorter images are larger: each length compiled at its rows
        model.image_rows = plan.rows_at(model.image_lengths) if plan.token_budget else {}
        model.compile_towers(plan.sub_batch, cuda_graphs=settings.cuda_graphs, scope=self.scope)
        self.seconds, self.done = 0.0, False

    def run(self) -> float:
        """Compile now (once: later calls return the first one's seconds)."""
        if self.done:
            return self.seconds
        cfg, env, plan = self.cfg, self.env, self.plan
        graph_free = plan.sub_batches > 1
        cache = CompileCache(cache_file(cfg, plan.sub_batch, graph_free, env.device, self.model.image_rows),
                             enabled=env.rank == 0)
        cache.load()
        if env.rank == 0:
            log.info("model.compile: compiling %s now%s", "each tower's transformer block once for all its layers "
                     "(model.compile_scope=block)" if self.scope == "block" else "the towers whole "
                     "(model.compile_scope=tower)", " (from the cache)" if cache.loaded else "")
        timers = compile_timers()
        self.seconds = self.model.warm_up(plan.sub_batch, env.device, self.precision.autocast,
                                          graph_free=graph_free, options=self.options)
        self.done = True
        if env.rank == 0:
            split = describe_split(timers, compile_timers(), self.seconds)
            log.info("model.compile: the towers compiled in %.1f s%s", self.seconds, f" ({split})" if split else "")
        cache.save()
        return self.seconds


def build_step(cfg: DictConfig, env: DistEnv, model: ClipModel, loss, plan: BatchPlan, precision: Precision,
               offload: Offload | None = None, *, warm_up: bool = True,
               auto: SubBatchChoice | None = None, settings: RunSettings | None = None) -> BuiltStep:
    """The step a run of ``cfg`` trains ``model`` (``prepare_model``'s) with at ``plan``: the
    optimizer, the text tower's trimming, the compiled towers (``model.compile``; compiled here, or
    later by the returned ``compilation.run()`` with ``warm_up=False``), and the ``TrainStep``, with
    the kept graphs and FSDP reduction ``trainer.sub_batch=auto``'s plan (``auto``) chose. ``settings``: the
    config's parsed settings (``RunSettings.of(cfg)``, the caller's where it has them)."""
    settings = settings or RunSettings.of(cfg)
    optimizer, peak_lr = build_optimizer(settings.optim, model, plan.global_batch)
    layer_decay = settings.optim.layer_decay
    if (layer_decay is not None or getattr(optimizer, "splits_matrices", False)) and env.rank == 0:
        log.info("optimizer groups (optim.layer_decay %s): each group's learning rate is the schedule's times its "
                 "scale\n%s", layer_decay, "\n".join(describe_param_groups(optimizer)))
    # before compiling: the text tower's lengths vary. Not where a caption decoder reads the captions whole (its
    # objective never cuts them): the text tower then compiles for the whole context alone
    untrimmed = model.trim_text(settings.model.trim_text and settings.caption_weight <= 0)
    if settings.model.trim_text and settings.caption_weight > 0:
        untrimmed = f"loss.caption_weight={settings.caption_weight} (the caption decoder reads each caption whole)"
    if untrimmed and env.rank == 0:
        log.info("captions are encoded at their full context: %s", untrimmed)
    if settings.model.cuda_graphs:
        check_cuda_graphs(model, plan.sub_batches)
    # after the memory probe and the FLOP count, which run eagerly
    # the forwards the objectives will ask for (a caption decoder's loss, self_distill's views), compiled in the warm-up
    options = {key: True for key, on in (("caption", settings.caption_weight > 0), ("views", settings.self_distill.on))
               if on}
    compilation = Compilation(cfg, env, model, plan, precision, settings.model, options) \
        if settings.model.compile else None
    if compilation is not None and warm_up:
        compilation.run()
    fsdp_reduce = fsdp_reduction(settings, model, env, auto, precision)
    log_fsdp_reduction(fsdp_reduce, settings, model, env, precision)
    step = TrainStep(model, loss, optimizer, env.device, precision=precision, sub_batches=plan.sub_batches,
                     grad_clip=settings.optim.grad_clip, offload=offload,
                     keep_graph=kept_graphs(settings.trainer.keep_graph, auto.graphs_that_fit if auto else None, plan,
                                            env),
                     fsdp_reduce=fsdp_reduce, show_progress=env.rank == 0,
                     max_bad_steps=settings.trainer.max_bad_steps, ema=weight_average(settings.ema, model, env),
                     objectives=objectives_of(cfg, settings, model, loss, env, plan, precision),
                     contrastive_weight=settings.contrastive_weight)
    return BuiltStep(step, optimizer, peak_lr, compilation)


def objectives_of(cfg: DictConfig, settings: RunSettings, model: ClipModel, loss, env: DistEnv, plan: BatchPlan,
                  precision: Precision) -> list:
    """The training terms and loss inputs beside the contrastive loss (``train/step/objectives``): ``distill.teacher``'s
    features (the teacher the distilled loss was built with, ``distilled``), ``data.train.negatives_key``'s hard
    negatives, ``loss.caption_weight``'s caption loss (a CoCa's decoder; at full weight after the share
    ``loss.caption_warmup`` of ``plan``'s steps), ``self_distill``'s late terms (from the share ``self_distill.start``
    of ``plan``'s steps)."""
    caption = settings.caption_weight
    decoder = model.decoder if caption > 0 else None
    pad_id = (decoder.pad_id if decoder is not None else model.clip.pad_id) if caption > 0 else None
    caption_warmup_steps = start_step(settings.caption_warmup, plan.total_steps)  # 0 unless a caption term (validate)
    if caption_warmup_steps > 0 and env.rank == 0:
        log.info("loss.caption_warmup=%s: the caption term's weight rises from 0 to %s over the first %d steps of %d",
                 settings.caption_warmup, caption, caption_warmup_steps, plan.total_steps)
    late = settings.self_distill
    self_distill = None
    if late.on:
        first = start_step(late.start, plan.total_steps)
        self_distill = {"model": model, "settings": late, "start_step": first, "precision": precision}
        if env.rank == 0:
            log.info("self_distill: %s from step %d of %d (self_distill.start=%s): an EMA teacher of the image tower "
                     "(momentum %s, a whole copy on each rank), %d crops of %d px per image, %d%% of the patches "
                     "masked, heads of %d prototypes (%.1fM parameters); every GradCache sub-batch is encoded again",
                     " + ".join(f"{weight} x {name}" for name, weight in (("local-to-global", late.weight),
                                                                         ("masked prediction", late.masked_weight))
                                if weight > 0), first, plan.total_steps, late.start, late.teacher_momentum,
                     late.local_crops, late.local_size, round(100 * late.mask_ratio), late.prototypes,
                     sum(p.numel() for p in model.views.parameters()) / 1e6)
    return build_objectives(caption_weight=caption, pad_id=pad_id, teacher=getattr(loss, "teacher", None),
                            negatives=settings.data.train.negatives_key is not None, device=env.device,
                            decoder=decoder, self_distill=self_distill, caption_warmup_steps=caption_warmup_steps)


def weight_average(ema: EmaSettings, model: ClipModel, env: DistEnv) -> WeightAverage | None:
    """``ema.decay``'s moving average of ``model``'s trainable weights (after sharding: each rank its
    shards), or ``None`` where it is off; its memory logged once."""
    if ema.decay is None:
        return None
    average = WeightAverage(model, ema.decay, ema.every, ema.warmup_power)
    if env.rank == 0:
        held = sum(local(tensor).numel() * tensor.element_size() for tensor in average.average)
        log.info("ema: a moving average of %d weights (decay %s every %d step(s), warm-up power %s): %.2f GB on %s "
                 "per rank; evaluated with eval.<name>.weights (auto: raw and ema), exported with weights=ema",
                 len(average.names), ema.decay, ema.every, ema.warmup_power, held / 1e9, env.device)
    return average


def kept_graphs(keep_graph, graphs_that_fit: int | None, plan: BatchPlan, env: DistEnv) -> int:
    """``trainer.keep_graph``'s count of GradCache sub-batches whose phase-1 graphs are kept: ``auto``
    as many as ``trainer.sub_batch=auto``'s plan leaves room for (at least the last one; the last
    one alone where no plan measured the memory), ``true`` one, ``false`` none, or a number.
    ``TrainStep`` caps it (all but one sub-batch on several ranks)."""
    if keep_graph == "auto":
        count = 1 if graphs_that_fit is None else max(1, graphs_that_fit)
        if graphs_that_fit is not None and plan.sub_batches > 1 and env.rank == 0:
            log.info("trainer.keep_graph=auto: %d of the %d sub-batches keep their phase-1 graphs (room for %d)",
                     min(count, plan.sub_batches - (env.world_size > 1)), plan.sub_batches, graphs_that_fit)
        return count
    return int(keep_graph)


def fsdp_step_bytes(model: torch.nn.Module, bf16: bool) -> int:
    """What ``trainer.fsdp_reduce=step`` holds through a step besides the sharded state: every
    trainable parameter's unsharded fp32 gradient (to the step's one reduce-scatter) and every
    weight gathered (bf16 with bf16 towers; kept to the step's end: ``fsdp.gathered_through``)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad) * 4 + sum(p.numel() for p in params) * (2 if bf16 else 4)


def fsdp_reduction(settings: RunSettings, model: ClipModel, env: DistEnv, auto: SubBatchChoice | None,
                   precision: Precision) -> str:
    """``trainer.fsdp_reduce`` as this run does it: ``sub_batch`` or ``step``. ``auto``: what
    ``trainer.sub_batch=auto``'s plan chose (``choose_sub_batch``), else ``step`` where the whole
    gradient and the gathered weights take at most a quarter of the GPU's free memory (on the CPU:
    always), else ``sub_batch``."""
    reduce = settings.trainer.fsdp_reduce
    if auto is not None and auto.fsdp_reduce is not None:
        reduce = auto.fsdp_reduce
    elif reduce == "auto":
        free = torch.cuda.mem_get_info(env.device)[0] if env.device.type == "cuda" else float("inf")
        reduce = "step" if fsdp_step_bytes(model, precision.name == "bf16") <= free / 4 else "sub_batch"
    return reduce


def log_fsdp_reduction(reduce: str, settings: RunSettings, model: ClipModel, env: DistEnv,
                       precision: Precision) -> None:
    trainer = settings.trainer
    if trainer.parallel == "fsdp" and env.distributed and env.rank == 0:
        log.info("FSDP: gradients reduce-scattered %s (trainer.fsdp_reduce=%s%s)",
                 "after each sub-batch" if reduce == "sub_batch" else
                 "once per step, the weights kept gathered through the step (the whole gradient and the gathered "
                 f"weights held meanwhile: {fsdp_step_bytes(model, precision.name == 'bf16') / 1e9:.2f} GB)",
                 trainer.fsdp_reduce, "" if trainer.fsdp_reduce != "auto" else f": {reduce}")


def check_exact_replay(model: ClipModel, plan: BatchPlan) -> None:
    """GradCache's replay of compiled towers that draw random numbers (dropout, patch dropout) redraws
    phase 1's draws only where inductor draws from torch's generator as eager code does
    (``fallback_random``, which ``megabatch.runtime.process.configure_backends`` sets for ``model.compile``)."""
    import torch._inductor.config as inductor_config

    drawn = model.random_modules()
    if plan.sub_batches > 1 and drawn and not inductor_config.fallback_random:
        raise RuntimeError(f"model.compile with GradCache and random draws in the towers ({', '.join(drawn)}): the "
                           "replay is exact only with inductor's fallback_random; call "
                           "megabatch.runtime.process.configure_backends(cfg, device) before building the step")


def step_without_data(cfg: DictConfig, env: DistEnv, offload: Offload | None = None) -> TrainStep:
    """The step a run of ``cfg`` trains with on ``env``'s rank, built as ``RunParts.build`` builds it
    but without data: the batch plan from ``batch`` and a numeric ``trainer.sub_batch``, one step an
    epoch. For the benchmarks and the tests, after ``configure_backends``."""
    settings = RunSettings.of(cfg)
    if settings.trainer.sub_batch == "auto":
        raise ConfigError("step_without_data() takes no trainer.sub_batch=auto (it has no data to plan with): "
                          "give a number")
    plan = BatchPlan.of(settings, env.world_size, num_samples=settings.batch)  # one step an epoch
    model, precision = build_model_for(cfg, settings, env), precision_of(settings, env)
    step = build_step(cfg, env, model, prepare_model(cfg, settings, model, env, precision), plan, precision, offload,
                      settings=settings).step
    seed_rank(settings, env)
    return step


def compile_scope(settings: ModelSettings) -> str:
    """``model.compile_scope``, ``auto`` resolved: each transformer block (one graph per tower and
    gradient mode, reused by every layer: the shortest compilation), or the towers whole with
    ``model.cuda_graphs`` (a CUDA graph records a whole tower)."""
    scope = settings.compile_scope
    return ("tower" if settings.cuda_graphs else "block") if scope == "auto" else scope


def precision_of(settings: RunSettings, env: DistEnv) -> Precision:
    """``trainer.precision`` and ``trainer.feature_dtype`` on ``env``'s device."""
    return Precision.create(settings.trainer.precision, env.device, settings.trainer.feature_dtype)


def seed_rank(settings: RunSettings, env: DistEnv) -> None:
    """Each rank's own random draws from here on (dropout, patch dropout): ``seed + 1000 x rank``."""
    torch.manual_seed(settings.seed + 1000 * env.rank)


def build_gpu_decoder(data: DataSettings, env: DistEnv) -> tuple[GpuDecoder | None, float]:
    """The GPU JPEG decoder (``data.decode``: gpu, or auto on CUDA) and the GPU bytes it may fill
    ahead of the step (``decode_ahead_bytes``); ``(None, 0)`` when the CPU decodes."""
    if resolve_decode(data.decode, env.device) != "gpu":
        return None, 0.0
    threads = None if data.decode_threads == "auto" else data.decode_threads
    kept = Path(data.cache_dir).expanduser() / KEPT_HARDWARE_FILE if data.cache_dir else None
    return GpuDecoder(env.device, threads=threads, kept=kept), \
        decode_ahead_bytes(data, torch.cuda.get_device_properties(env.device).total_memory)


def check_cuda_graphs(model: ClipModel, sub_batches: int) -> None:
    """``model.cuda_graphs`` is for the one-pass step of towers that draw no random numbers: graphs
    save the launches of a small step, a GradCache step's kernels keep the GPU busy without them,
    a graph's memory is reused by its next call (phase 1's kept graph would be overwritten), and
    with random draws the graphs' gradients are not exact. Raises a ``ConfigError`` naming the
    setting otherwise (docs/performance.md has the measurements behind it)."""
    if sub_batches > 1:
        raise ConfigError(f"model.cuda_graphs=true is for the one-pass step, and this run's step is {sub_batches} "
                          "GradCache sub-batches: their kernels keep the GPU busy without graphs, and the graphs' "
                          "reuse of memory from one call to the next would overwrite the graph phase 1 keeps; set "
                          "model.cuda_graphs=false (or trainer.sub_batch=null with a batch that fits)")
    drawn = model.random_modules()
    if drawn:
        raise ConfigError(f"model.cuda_graphs=true: the towers draw random numbers in training ({', '.join(drawn)}), "
                          "and with them the graphs' gradients are not the compiled towers' (not exact); set "
                          "their probability to 0 (e.g. model.image.patch_dropout=0) or "
                          "model.cuda_graphs=false")


def shard(settings: RunSettings, model: ClipModel, env: DistEnv, precision: Precision) -> None:
    """``trainer.parallel=fsdp``: shard the model across the ranks (``distributed/fsdp.py``); on one
    rank there is nothing to shard, and the model stays whole (its checkpoints are still sharded ones)."""
    if settings.trainer.parallel != "fsdp":
        return
    if not env.distributed:
        log.info("trainer.parallel=fsdp on one rank: nothing to shard, the model stays whole")
        return
    size = shard_size(settings.trainer.fsdp_shard_size, env.world_size)
    groups = shard_model(model, env.device, bf16=precision.name == "bf16", shard_size=size)
    if env.rank == 0:
        log.info("FSDP: %d groups sharded across %d ranks (%s of each rank's weights, gradients and AdamW moments)%s",
                 groups, size, f"1/{size}", "" if size == env.world_size else
                 f", replicated across {env.world_size // size} such groups (HSDP; trainer.fsdp_shard_size)")


def shard_size(setting: int | str, world_size: int) -> int:
    """``trainer.fsdp_shard_size``: the ranks one copy of the model is sharded across (``auto``: a node's, torchrun's
    ``LOCAL_WORLD_SIZE``, the whole job where it is not set); a count that does not divide the job's is refused."""
    size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if setting == "auto" else int(setting)
    size = min(size, world_size)
    if world_size % size:
        raise ConfigError(f"trainer.fsdp_shard_size={setting} ({size} ranks) does not divide the job's {world_size} "
                          "ranks: give a divisor of it (the GPUs of a node), or auto")
    return size


def check_bias(model: ClipModel, loss) -> None:
    """A sigmoid loss needs the model's logit bias; a softmax loss leaves it without a gradient
    (which DDP refuses). ``validate`` checks the configured bias; this, the built model's (an
    open_clip architecture or pretrained folder may bring one)."""
    uses_bias = getattr(loss, "uses_bias", False)
    if uses_bias and model.logit_bias is None:
        raise ConfigError(f"{type(loss).__name__} needs a logit bias and model {model.name} has none: set "
                          "model.init_logit_bias (SigLIP's is -10)")
    if model.logit_bias is not None and not uses_bias:
        raise ConfigError(f"model {model.name} has a logit bias (a sigmoid-loss model) but {type(loss).__name__} "
                          "takes none: train it with loss=siglip")


def plan_batches(settings: RunSettings, world_size: int, data: TrainData, sub_batch: int | None = None,
                 token_budget: int | None = None) -> BatchPlan:
    """The batch plan, built once, with the epoch length the data can give every rank (``sub_batch``:
    ``trainer.sub_batch=auto``'s choice; ``token_budget``: its token budget, a NaFlex tower's)."""
    def steps_per_epoch(global_batch: int, sub: int) -> int:
        steps = data.steps_per_epoch(global_batch, world_size, sub)
        if steps == 0:  # shard split: each worker of each rank fills only its own shards
            raise ConfigError(f"batch={global_batch} is larger than what the shards give each of "
                              f"{world_size} ranks x {data.workers} workers in one epoch; lower batch or "
                              "data.num_workers")
        return steps

    naflex = data.transform if isinstance(data.transform, NaFlexSpec) else None
    if settings.trainer.sub_batch_tokens is not None and naflex is not None and data.split == "shard":
        raise ConfigError(f"trainer.sub_batch_tokens={settings.trainer.sub_batch_tokens} with data.train.split=shard: "
                          "that split draws each image's sequence length by a position of its own shard, so a "
                          "sub-batch mixes lengths and ranks would join their sub-batches differently; use "
                          "data.train.split=indexed (local .tar shards) or position, or trainer.sub_batch")
    return BatchPlan.of(settings, world_size, data.num_samples, steps_per_epoch, sub_batch=sub_batch,
                        longest=None if naflex is None else max(naflex.seq_lens), token_budget=token_budget)


def choose_sub_batch(settings: RunSettings, model: ClipModel, env: DistEnv, precision: Precision,
                     decode_ahead: float = 0.0, teacher=None, join_lengths: bool = False,
                     probe_cache: ProbeCache | None = None) -> SubBatchChoice | None:
    """``trainer.sub_batch=auto``: the largest divisor of the per-rank batch whose forward-backward
    fits ``trainer.memory_fraction`` of the GPU (``memory_plan.py``), the smallest over the ranks
    (they must agree), and the kept graphs the rest of the memory holds (``graphs_that_fit``, the
    smallest over the ranks); ``None`` when the config gives a number or null. ``decode_ahead``: the GPU bytes
    kept for images decoded ahead of the step (``data.decode_ahead_gb``), left free. ``teacher``:
    ``distill.teacher``'s (its features of the batch are held too). ``join_lengths``: a NaFlex tower trained at
    several sequence lengths, whose sub-batches a token budget may join (not under the shard split): measured at
    each length, the choice is a token budget (``SubBatchChoice.token_budget``, ``memory_plan.LengthFits``).
    ``probe_cache``: where the measured peaks are kept across runs (``memory_plan.ProbeCache``)."""
    trainer = settings.trainer
    if trainer.sub_batch != "auto":
        return None
    rank_batch = rank_batch_of(settings.batch, env.world_size)
    if env.device.type != "cuda":
        if env.rank == 0:
            log.info("trainer.sub_batch=auto on the CPU: no GPU memory to fit, the whole per-rank batch (%d)",
                     rank_batch)
        return SubBatchChoice(rank_batch, 0.0, 0.0, MemoryFit(0.0, 0.0), graphs_that_fit=0)
    caption = settings.caption_weight > 0 and model.has_decoder  # the replay runs the caption decoder too
    views = settings.self_distill.on  # the late steps' replay: the student's views too (the largest sub-batch)
    sizes = sorted({min(rank_batch, 32), min(rank_batch, 64)})
    lengths = sorted(model.image_lengths) if join_lengths and len(model.image_lengths) > 1 else [None]
    asked = {"sizes": sizes, "lengths": lengths, "caption": caption, "views": views}
    probe_cache = probe_cache or ProbeCache()
    measured = probe_cache.read(asked)
    kept = measured is not None
    if measured is None:
        measured = {length: [(rows, *probe_peak_memory(model, rows, precision, env.device, caption, views, length))
                             for rows in sizes] for length in lengths}
        probe_cache.write(asked, measured)
    probes = measured[lengths[-1]]  # the longest length's (the only one without joining)
    if len(probes) == 1:  # a per-rank batch of at most 32: the probe ran it whole
        return SubBatchChoice(rank_batch, float(probes[0][1]), 0.0, MemoryFit(0.0, 0.0), graphs_that_fit=0)
    offload, replayed = trainer.offload, not model.frozen("image")
    images, texts = model.example_inputs(1, torch.device("meta"))  # one row's shapes
    kept_per_row = texts.numel() * 8 + (0 if offload or not replayed else images.numel())
    held = batch_bytes(rank_batch, int(model.model_cfg["embed_dim"]), precision.feature_dtype.itemsize, kept_per_row,
                       rank_trainable_params(model))
    held += decode_ahead  # images decoded ahead of the step (data.decode_ahead_gb)
    if teacher is not None:  # distill.teacher: its features of the batch (its weights are in the probes)
        held += teacher_bytes(rank_batch, env.world_size, math.prod(teacher.shape), precision.feature_dtype.itemsize,
                              int(model.model_cfg["embed_dim"]))
    capacity = torch.cuda.get_device_properties(env.device).total_memory
    fit = MemoryFit.through(probes) if lengths == [None] else \
        LengthFits({length: MemoryFit.through(each) for length, each in measured.items()}, rank_batch)
    fraction = trainer.memory_fraction
    reduce = trainer.fsdp_reduce if trainer.parallel == "fsdp" and env.distributed else None
    whole = fsdp_step_bytes(model, precision.name == "bf16") if reduce is not None else 0
    choice, reduce = plan_sub_batch_and_reduction(rank_batch, fit, capacity, fraction, held, whole, reduce)
    held += whole if reduce == "step" else 0
    sub_batch, stepwise_flag = choice.sub_batch, int(reduce == "step")
    if env.distributed:  # every rank must split its batch alike, keep as many graphs and reduce alike
        agreed = torch.tensor([sub_batch, stepwise_flag], device=env.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        sub_batch, stepwise_flag = (int(v) for v in agreed.tolist())
        predicted = choice.fit.peak(sub_batch) + held  # (LengthFits: the largest of the lengths' joined peaks)
        graphs = torch.tensor([graphs_in(choice.budget_bytes - predicted, choice.fit, sub_batch)], device=env.device)
        dist.all_reduce(graphs, op=dist.ReduceOp.MIN)
        choice = SubBatchChoice(sub_batch, predicted, choice.budget_bytes, choice.fit, int(graphs.item()))
    if reduce is not None:
        choice = dataclasses.replace(choice, fsdp_reduce="step" if stepwise_flag else "sub_batch")
    if env.rank == 0:
        log.info("trainer.sub_batch=auto: %d (peak memory measured at %s: %.2f GB + %.1f MB per sample, a graph "
                 "%.2f MB per sample; with %.1f GB held for the per-rank batch of %d, %.1f of %.1f GB predicted, "
                 "room for %d kept graphs; trainer.memory_fraction=%s)", sub_batch,
                 " and ".join(f"{rows} ({peak / 1e9:.2f} GB)" for rows, peak, _ in probes), choice.fit.fixed / 1e9,
                 choice.fit.per_row / 1e6, choice.fit.graph_per_row / 1e6, held / 1e9, rank_batch,
                 choice.predicted_bytes / 1e9, capacity / 1e9, choice.graphs_that_fit, trainer.memory_fraction)
        if kept:
            log.info("trainer.sub_batch=auto: the peaks measured by an earlier run of this model on this GPU, kept in "
                     "%s (MEGABATCH_PROBE_CACHE=0 measures again)", probe_cache.path)
        if isinstance(choice.fit, LengthFits):
            log.info("trainer.sub_batch=auto, a NaFlex tower measured at each sequence length: a token budget of %d "
                     "patches (%d images at the longest), joined sub-batches of %s; peaks measured at %s",
                     choice.token_budget, sub_batch, ", ".join(
                         f"{rows} at {length} patches" for length, rows in sorted(choice.fit.rows(sub_batch).items())),
                     "; ".join(f"{length} patches: " + " and ".join(f"{rows} ({peak / 1e9:.2f} GB)"
                                                                    for rows, peak, _ in each)
                               for length, each in measured.items()))
    return choice


def rank_trainable_params(model: torch.nn.Module) -> int:
    """The trainable parameters this rank holds AdamW's moments for: its shards under FSDP, all of
    them otherwise."""
    return sum(local(p).numel() for p in model.parameters() if p.requires_grad)


def model_flops(cfg: DictConfig, settings: RunSettings, model: ClipModel, env: DistEnv) -> ModelFlops:
    """The towers' FLOPs per sample (``count_model_flops`` on ``flop_rows`` rows, eagerly under the FLOP counter:
    0.24-0.58 s of a ViT-B/16 start on an H200), kept on a GPU in ``<data.cache_dir>/flops/`` under the probes' key
    (``memory_plan.probe_key``: the model's config, the library versions, megabatch's source) and the rows, so that
    the same command again reads them. ``MEGABATCH_PROBE_CACHE=0``: always counted."""
    rows, path = flop_rows(settings, env), None
    if kept_measurements(cfg, env.device):
        path = keyed_file(cfg, "flops", {**probe_key(cfg, 0, 1, env.device), "rows": rows}, "json")
        try:
            return ModelFlops(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass  # none kept yet, or unreadable: counted
    flops = count_model_flops(model, *model.example_inputs(rows, env.device))
    if path is not None:
        try:
            replace_json(path, dataclasses.asdict(flops))
        except OSError:
            pass  # counted again next time
    return flops


def flop_rows(settings: RunSettings, env: DistEnv) -> int:
    """Rows of the sample batch the FLOPs are counted on: a sub-batch, 256 at most (the count is
    per sample; ``trainer.sub_batch=auto`` is chosen later, so the per-rank batch stands in for it)."""
    configured = settings.trainer.sub_batch
    return min(configured if isinstance(configured, int) else rank_batch_of(settings.batch, env.world_size), 256)


def decode_ahead_bytes(data: DataSettings, capacity: float) -> float:
    """``data.decode_ahead_gb`` in bytes (``auto``: 2.5% of the GPU's ``capacity``: 2 GB on an 80 GB
    GPU, 26 finished sub-batches of 512 images at 224 px): decoding goes on through the loss and the
    replay, so the next phase 1 finds most of its sub-batches decoded, and the decoding threads keep
    up with the rest."""
    budget = data.decode_ahead_gb
    return 0.025 * capacity if budget == "auto" else budget * 1e9


def log_utilization_basis(flops: ModelFlops, peak: Peak | None, gpu_decode: bool, ahead: float) -> None:
    log.info("model FLOPs per sample: image %.2f + text %.2f GFLOP forward, %.2f GFLOP per trained sample; GPU peak "
             "%s; JPEG decoding on the %s (data.decode)%s", flops.image_forward / 1e9, flops.text_forward / 1e9,
             flops.per_sample / 1e9, f"{peak.tflops:.0f} TFLOP/s bf16, {peak.source}" if peak else "none (CPU)",
             "GPU" if gpu_decode else "CPU",
             f", up to {ahead / 1e9:.1f} GB of images decoded ahead of the step (data.decode_ahead_gb)"
             if gpu_decode else "")


def build_offload(cfg: DictConfig, settings: RunSettings, model: ClipModel, data: TrainData, rank: int,
                  gpu_decoder: GpuDecoder | None = None) -> Offload | None:
    """The owner of the image bytes a GradCache step keeps for its replay (``trainer.offload``)."""
    if not settings.trainer.offload:
        return None
    if model.frozen("image"):
        log.warning("trainer.offload has no effect with a locked image tower: its images are "
                    "encoded once and never replayed")
        return None
    return Offload(data.transform, settings.seed, settings.data.num_workers, settings.trainer.offload_dir, rank,
                   gpu_decoder)
