"""FSDP (``trainer.parallel=fsdp``) on 2 gloo ranks: the gradients and the update of DDP, through
GradCache, with a locked tower and the sigmoid loss's bias; sharded checkpoints."""

from __future__ import annotations

import pytest
import torch

from ..helpers import rel_error, run_ranks
from ..train.test_gradcache import flat, step_gradients

COMMON = ["trainer.sub_batch=4", "model.image.patch_dropout=0"]


def ddp_and_fsdp(rank: int, world: int, overrides: list[str]) -> dict:
    """The same step built twice in one process group: replicated (DDP), then sharded."""
    return {"ddp": step_gradients(rank, world, COMMON + overrides, step=True),
            "fsdp": step_gradients(rank, world, COMMON + overrides + ["trainer.parallel=fsdp"], step=True)}


@pytest.mark.parametrize("overrides", [
    # both towers, every exact option on (captions cut, graphs kept: all but the last sub-batch's, the most
    # allowed on several ranks), a reduce-scatter per sub-batch
    ["loss=local", "trainer.fsdp_reduce=sub_batch", "trainer.keep_graph=8"],
    # LiT (a locked image tower: no shard of it has a gradient), the sigmoid loss's bias, one reduction per step
    ["loss=siglip", "loss.tile=8", "model.init_logit_bias=-10", "model.lock_image=true", "trainer.fsdp_reduce=step"],
], ids=["gradcache", "locked-siglip-once-per-step"])
def test_fsdp_gives_the_gradients_and_update_of_ddp(overrides, tmp_path):
    ranks = run_ranks(2, ddp_and_fsdp, overrides, tmp_path=tmp_path)
    for result in ranks:
        ddp, fsdp = result["ddp"], result["fsdp"]
        assert fsdp["grads"].keys() == ddp["grads"].keys()
        scalars = [name for name in ("clip.logit_scale", "clip.logit_bias") if name in ddp["grads"]]
        assert len(scalars) == (2 if "loss=siglip" in overrides else 1)
        for name in scalars:  # left whole by FSDP, averaged by hand: still the mean over the ranks
            assert ddp["grads"][name].abs() > 0
            assert rel_error(fsdp["grads"][name], ddp["grads"][name]) <= 1e-5, name
        assert rel_error(flat(fsdp["grads"]), flat(ddp["grads"])) <= 1e-5
        assert rel_error(flat(fsdp["grads"]) * 2, flat(ddp["grads"])) > 0.5  # not vacuous: a missed average shows
        if "model.lock_image=true" in overrides:
            assert not any(name.startswith("clip.visual.") for name in fsdp["grads"])
        for name, value in ddp["params"].items():  # the SGD step on the shards: DDP's update
            assert rel_error(fsdp["params"][name], value) <= 1e-6, name
    for name, value in ranks[0]["fsdp"]["params"].items():  # the gathered weights agree on every rank
        assert torch.equal(value, ranks[1]["fsdp"]["params"][name]), name


def what_sub_batch_auto_sees(rank: int, world: int) -> dict:
    """``RunParts.build`` with FSDP and ``trainer.sub_batch=auto``: the model its memory probe runs,
    and the parameters it counts AdamW moments for on this rank."""
    import megabatch.train.parts as parts
    from megabatch.config.schema import validate
    from megabatch.distributed import init_distributed
    from megabatch.distributed.fsdp import is_sharded

    from ..helpers import compose

    seen, choose = {}, parts.choose_sub_batch

    def recording(cfg, model, env, *args):
        seen.update(sharded=is_sharded(model), counted=parts.rank_trainable_params(model),
                    whole=sum(p.numel() for p in model.parameters() if p.requires_grad))
        return choose(cfg, model, env, *args)

    parts.choose_sub_batch = recording
    built = parts.RunParts.build(validate(compose("trainer.parallel=fsdp", "trainer.sub_batch=auto", "batch=16")),
                                 init_distributed("cpu"))
    built.close()
    return seen


def test_sub_batch_auto_measures_a_ranks_shard_under_fsdp(tmp_path):
    for seen in run_ranks(2, what_sub_batch_auto_sees, tmp_path=tmp_path):
        assert seen["sharded"]  # probed after sharding: the memory a rank trains with
        assert 0.4 * seen["whole"] <= seen["counted"] <= 0.6 * seen["whole"]  # half the moments each
