"""A training step of the tiny model with each distributed backend on 2 gloo ranks gives the
averaged parameter gradients (logit_scale included) of `loss=vanilla` in one process."""

from __future__ import annotations

import torch

from ..helpers import gradients, rel_error, run_ranks

BACKENDS = ["local", "disco", "infcl"]


def every_backend(rank: int, world: int) -> dict:
    return {name: gradients(rank, world, [f"loss={name}", "loss.tile=5"] if name == "infcl"
                            else [f"loss={name}"]) for name in BACKENDS}


def test_distributed_backends_match_one_process_vanilla(tmp_path):
    reference = gradients(0, 1, ["loss=vanilla"])
    per_rank = run_ranks(2, every_backend, tmp_path=tmp_path)
    flat_ref = torch.cat([g.flatten() for g in reference.values()])
    for name in BACKENDS:
        for grads in per_rank:
            grads = grads[name]
            assert grads.keys() == reference.keys()
            assert rel_error(grads["clip.logit_scale"], reference["clip.logit_scale"]) <= 1e-5, name
            flat = torch.cat([g.flatten() for g in grads.values()])
            assert rel_error(flat, flat_ref) <= 1e-5, name
            for key, expected in reference.items():
                assert rel_error(grads[key], expected) <= 1e-4, (name, key)
