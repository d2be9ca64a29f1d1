"""What one rank of a run trains with, built from a validated config: the model and its tokenizer,
the data and the batch plan, the optimizer and the schedule, the offload owner, the sub-batch
stream and the step. No run directory, checkpoints or logs: those are the ``Trainer``'s.

    parts = RunParts.build(validate(compose("trainer.sub_batch=16")), init_distributed("cpu"))
    loss, times = parts.step.gradients(parts.inputs(0))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from ..config import ConfigError
from ..data import TrainData
from ..data.offload import Offload
from ..distributed import DistEnv
from ..models import ClipModel, build_model
from ..models.preprocess import describe_preprocess
from .inputs import RunInputs, read_ahead_budget
from .optim import build_optimizer
from .plan import BatchPlan
from .step import TrainStep

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

    @classmethod
    def build(cls, cfg: DictConfig, env: DistEnv) -> RunParts:
        """Build every part for ``env``'s rank. Seeds torch with ``cfg.seed`` first, so every rank
        starts from the same weights, and with ``cfg.seed + 1000 x rank`` last, so each rank
        draws its own dropout and patch-dropout masks."""
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        model = build_model(cfg.model).to(env.device)
        tokenize = model.tokenizer()  # the model's own, as its image size and preprocessing below
        if env.rank == 0:
            log.info("model %s: preprocessing %s", model.name, describe_preprocess(model.preprocess))
        data = TrainData(cfg.data, tokenize, model.preprocess, cfg.seed, show_progress=env.rank == 0)
        plan = plan_batches(cfg, env.world_size, data)
        loss = instantiate(cfg.loss)
        check_bias(model, loss)
        optimizer, peak_lr = build_optimizer(cfg.optim, model, plan.global_batch)
        schedule = instantiate(cfg.sched, total_steps=plan.total_steps, global_batch=plan.global_batch)
        if env.device.type == "cuda":  # TF32 for fp32 matmuls (the loss on fp32 features)
            torch.backends.cuda.matmul.allow_tf32 = cfg.trainer.tf32
            torch.backends.cudnn.allow_tf32 = cfg.trainer.tf32
        offload = build_offload(cfg, model, data, env.rank)
        inputs = RunInputs(data, plan, env.rank, keep_raw=offload is not None,
                           pin_memory=env.device.type == "cuda",
                           read_ahead_bytes=read_ahead_budget(cfg.trainer.prefetch_gb, cfg.trainer.offload))
        step = TrainStep(model, loss, optimizer, env.device, precision=cfg.trainer.precision,
                         sub_batches=plan.sub_batches, feature_dtype=cfg.trainer.feature_dtype,
                         grad_clip=cfg.optim.grad_clip, offload=offload, show_progress=env.rank == 0)
        torch.manual_seed(cfg.seed + 1000 * env.rank)  # per-rank randomness (dropout, ...)
        return cls(model, tokenize, data, plan, optimizer, peak_lr, schedule, offload, inputs, step)

    def close(self) -> None:
        """Stop the offload's re-decode workers and delete its spill file."""
        if self.offload is not None:
            self.offload.close()


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


def plan_batches(cfg: DictConfig, world_size: int, data: TrainData) -> BatchPlan:
    """The batch arithmetic, with the epoch length the data can give every rank."""
    plan = BatchPlan.from_config(cfg, world_size, data.num_samples)
    steps = data.steps_per_epoch(plan.global_batch, world_size, plan.sub_batch)
    if steps == plan.steps_per_epoch:
        return plan
    if steps == 0:  # shard split: each worker of each rank fills only its own shards
        raise ConfigError(f"batch={plan.global_batch} is larger than what the shards give each of "
                          f"{world_size} ranks x {data.workers} workers in one epoch; lower batch or "
                          "data.num_workers")
    return BatchPlan.from_config(cfg, world_size, data.num_samples, steps_per_epoch=steps)


def build_offload(cfg: DictConfig, model: ClipModel, data: TrainData, rank: int) -> Offload | None:
    """The owner of the image bytes a GradCache step keeps for its replay (``trainer.offload``)."""
    if not cfg.trainer.offload:
        return None
    if model.frozen("image"):
        log.warning("trainer.offload has no effect with a locked image tower: its images are "
                    "encoded once and never replayed")
        return None
    return Offload(data.transform, cfg.seed, cfg.data.num_workers, cfg.trainer.offload_dir, rank)
