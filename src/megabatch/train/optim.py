"""Optimizer construction: parameter groups, batch-scaled learning rate."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from ..config import ConfigError, parse_count

log = logging.getLogger(__name__)


def scaled_lr(lr: float, rule: str | None, global_batch: int, base_batch: Any) -> float:
    """``lr`` scaled from ``base_batch`` to ``global_batch``: ``linear`` (x b/b0), ``sqrt``
    (x sqrt(b/b0)) or ``None`` (unchanged)."""
    if rule in (None, "none"):
        return lr
    ratio = global_batch / parse_count(base_batch, "optim.base_batch")
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise ConfigError(f"optim.lr_scaling={rule!r}; use null, linear or sqrt")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: gains, biases, embeddings of rank 1 and logit_scale get none."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or "logit_scale" in name or name.endswith(".bias")
        (no_decay if exempt else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(cfg, model: nn.Module, global_batch: int) -> tuple[torch.optim.Optimizer, float]:
    """The configured optimizer over ``model`` and its peak learning rate."""
    lr = scaled_lr(float(cfg.lr), cfg.lr_scaling, global_batch, cfg.base_batch)
    if cfg.lr_scaling not in (None, "none"):
        log.info("lr %.3g scaled (%s) from base batch %s to %d: %.3g", cfg.lr, cfg.lr_scaling,
                 cfg.base_batch, global_batch, lr)
    factory = instantiate(cfg.optimizer, _convert_="all")  # plain lists in param_groups: checkpoints load weights_only
    kwargs = {}
    if "fused" not in cfg.optimizer and _takes_fused(factory) and next(model.parameters()).is_cuda:
        kwargs["fused"] = True  # one kernel for the whole update (CUDA); optim.optimizer.fused=false: foreach
    return factory(param_groups(model, float(cfg.weight_decay)), lr=lr, **kwargs), lr


def _takes_fused(factory) -> bool:
    """Whether the configured optimizer class (a ``functools.partial``) has a ``fused`` option."""
    import inspect

    cls = getattr(factory, "func", factory)
    try:
        return "fused" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
