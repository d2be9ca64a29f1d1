"""A 2-rank gloo DDP step gives the gradients of a 1-process step on the same global batch."""

from __future__ import annotations

import torch

from ..helpers import gradients, rel_error, run_ranks


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
