"""A 2-rank gloo DDP step gives the gradients of a 1-process step on the same global batch."""

from __future__ import annotations

import torch
from hydra.utils import instantiate
from torch.nn.parallel import DistributedDataParallel as DDP

from megabatch.models import build_tokenizer
from megabatch.train.step import forward_backward

from ..conftest import compose
from ..helpers import rel_error, run_ranks

GLOBAL_BATCH = 12


def fixed_batch(text_cfg):
    """Random images and real captions, tokenised by the configured text tower's tokenizer."""
    generator = torch.Generator().manual_seed(123)
    images = torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=generator)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    captions = [f"a handwritten {words[i % 10]} number {i}" for i in range(GLOBAL_BATCH)]
    return images, build_tokenizer(**text_cfg)(captions)


def gradients(rank: int, world: int, overrides: list[str]) -> dict[str, torch.Tensor]:
    """Gradients (DDP-averaged when world > 1) of one step on this rank's share of the batch."""
    cfg = compose(*overrides)
    torch.manual_seed(0)
    model = instantiate(cfg.model, _convert_="all")
    loss_fn = instantiate(cfg.loss)
    wrapped = DDP(model) if world > 1 else model
    images, texts = fixed_batch(cfg.model.text)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    forward_backward(wrapped, loss_fn, images[rows], texts[rows], "fp32", torch.device("cpu"))
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_two_rank_ddp_step_equals_one_process(tmp_path):
    overrides = ["loss=vanilla"]
    reference = gradients(0, 1, overrides)
    ranks = run_ranks(2, gradients, overrides, tmp_path=tmp_path)
    assert reference.keys() == ranks[0].keys() and "clip.logit_scale" in reference
    for grads in ranks:
        for name, expected in reference.items():
            assert rel_error(grads[name], expected) <= 1e-5, name
    flat = torch.cat([g.flatten() for g in ranks[0].values()])
    flat_ref = torch.cat([g.flatten() for g in reference.values()])
    assert rel_error(flat, flat_ref) <= 1e-5
    # not vacuous: a gradient that misses the W factor (or double counts) is far off
    assert rel_error(flat * 2, flat_ref) > 0.5
    assert reference["clip.logit_scale"].abs() > 0
