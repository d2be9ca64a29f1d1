"""Evaluate a training checkpoint: rebuild the model from the description stored inside it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..checkpoint.files import EMA, load_checkpoint, model_weights
from ..checkpoint.model import model_from_checkpoint
from ..config.schema import check_eval
from ..distributed.env import init_distributed
from .zeroshot import result_name, run_zeroshot, weights_to_evaluate

log = logging.getLogger(__name__)


def evaluate_checkpoint(cfg) -> dict[str, dict]:
    """Every set of ``cfg.eval`` on the model in ``cfg.ckpt``: ``{set name: result}`` (top-1/top-5
    or recalls, and the step). Under torchrun every rank loads the model and encodes its share of each set
    (``eval/ranks.py``); every rank returns the same results."""
    check_eval(cfg.eval)  # each evaluation set's data is given, before the model is built
    if not cfg.eval:
        from ..config import ConfigError

        raise ConfigError("eval=none: name the evaluation set(s), e.g. eval=imagenet or eval=[imagenet,imagenet_v2]")
    env = init_distributed(cfg.device if cfg.device in ("auto", "cpu", "cuda") else "auto")
    ended = "failed"
    try:
        results = _evaluate(cfg, env)
        ended = "finished"
        return results
    finally:  # under torchrun: the heartbeat thread and the process group end before the interpreter does (left
        # running into its exit, their threads can abort the process: "terminate called without an active exception")
        if env.peers is not None:
            env.peers.end(ended)
        if env.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _evaluate(cfg, env) -> dict[str, dict]:
    state = load_checkpoint(cfg.ckpt)
    device = env.device if cfg.device in ("auto", "cpu", "cuda") else torch.device(cfg.device)
    model = model_from_checkpoint(state).to(device)
    tokenize = model.tokenizer()
    data_cfg = OmegaConf.create({"cache_dir": cfg.cache_dir})
    features = cfg.get("features", "auto")
    cache_root = Path(cfg.ckpt).with_suffix(".features") if features == "auto" else Path(features) if features \
        else None
    results, loaded = {}, "raw"
    for name, eval_cfg in cfg.eval.items():
        for weights in weights_to_evaluate(eval_cfg.weights, bool((state.get(EMA) or {}).get("weights"))):
            if weights != loaded:  # the moving average (ema.decay) or the weights as trained
                model.load_state_dict(model_weights(state, weights, f"eval.{name}.weights"))
                loaded = weights
            if env.rank == 0:
                log.info("evaluating %s (step %d, %s weights) on %s%s", cfg.ckpt, state["step"], weights, name,
                         f" with {env.world_size} ranks" if env.distributed else "")
            started = time.perf_counter()
            result = run_zeroshot(model, tokenize, eval_cfg, data_cfg, device,
                                  cache=str(cache_root / weights) if cache_root else None)
            results[result_name(name, weights)] = {**result, "seconds": round(time.perf_counter() - started, 3),
                                                   "step": int(state["step"]), "ckpt": str(cfg.ckpt),
                                                   "weights": weights}
    return results
