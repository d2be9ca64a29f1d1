"""Evaluate a training checkpoint: rebuild the model from the config stored inside it."""

from __future__ import annotations

import logging

import torch
from omegaconf import OmegaConf

from ..checkpoint import build_stored, load_checkpoint
from ..config.schema import check_eval
from ..models import build_tokenizer
from .zeroshot import run_zeroshot

log = logging.getLogger(__name__)


def evaluate_checkpoint(cfg) -> dict:
    """Zero-shot ``cfg.eval`` on the model in ``cfg.ckpt``; returns top-1/top-5 and the step."""
    check_eval(cfg.eval)  # the evaluation set's data is given, before the model is built
    state = load_checkpoint(cfg.ckpt)
    train_cfg = OmegaConf.create(state["config"])
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else "cpu" if cfg.device == "auto" else cfg.device)
    model = build_stored(train_cfg.model, "model")  # only megabatch's own targets: a crafted file runs nothing
    model.load_state_dict(state["model"])
    model.to(device)
    tokenize = build_tokenizer(**train_cfg.model.text)
    log.info("evaluating %s (step %d) on %s", cfg.ckpt, state["step"], cfg.eval.name)
    data_cfg = OmegaConf.create({"cache_dir": cfg.cache_dir})
    result = run_zeroshot(model, tokenize, cfg.eval, data_cfg, train_cfg.model.image.image_size, device)
    return {**result, "step": int(state["step"]), "ckpt": str(cfg.ckpt)}
