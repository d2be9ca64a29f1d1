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
    # model.decoder's caption term (the decoder's blocks sharded too; the image tower's tokens through its own forward)
    ["loss=local", "model.decoder.layers=1", "model.decoder.width=32", "model.decoder.heads=2",
     "loss.caption_weight=1.0"],
    # self_distill's late terms (the student's views through the sharded tower, the teacher whole on each rank)
    ["loss=local", "self_distill.weight=1.0", "self_distill.masked_weight=0.25", "self_distill.start=0",
     "self_distill.local_crops=2", "self_distill.local_size=16", "self_distill.prototypes=32",
     "self_distill.hidden=32", "self_distill.bottleneck=16"],
], ids=["gradcache", "locked-siglip-once-per-step", "decoder", "self-distill"])
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
    import megabatch.train.build.parts as parts
    from megabatch.config.schema import validate
    from megabatch.distributed import init_distributed
    from megabatch.distributed.fsdp import is_sharded

    from ..helpers import compose

    seen, choose = {}, parts.choose_sub_batch

    def recording(cfg, model, env, *args, **kwargs):
        seen.update(sharded=is_sharded(model), counted=parts.rank_trainable_params(model),
                    whole=sum(p.numel() for p in model.parameters() if p.requires_grad))
        return choose(cfg, model, env, *args, **kwargs)

    parts.choose_sub_batch = recording
    built = parts.RunParts.build(validate(compose("trainer.parallel=fsdp", "trainer.sub_batch=auto", "batch=16")),
                                 init_distributed("cpu"))
    built.close()
    return seen


def test_sub_batch_auto_measures_a_ranks_shard_under_fsdp(tmp_path):
    for seen in run_ranks(2, what_sub_batch_auto_sees, tmp_path=tmp_path):
        assert seen["sharded"]  # probed after sharding: the memory a rank trains with
        assert 0.4 * seen["whole"] <= seen["counted"] <= 0.6 * seen["whole"]  # half the moments each


def two_steps(rank: int, world: int, overrides: list[str]) -> dict:
    """Two ``TrainStep.step`` updates (2 sub-batches each), replicated (DDP) and sharded with each
    ``trainer.fsdp_reduce``: the weights after them, and FSDP's all-gathers in each step."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from megabatch.distributed.fsdp import full

    from ..train.test_gradcache import build

    gathers, original = [], _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        gathers[-1] += 1
        return original(*args, **kwargs)

    result = {}
    for name, extra in (("ddp", []), ("step", ["trainer.parallel=fsdp", "trainer.fsdp_reduce=step"]),
                        ("sub_batch", ["trainer.parallel=fsdp", "trainer.fsdp_reduce=sub_batch"])):
        parts = build(*COMMON, *overrides, *extra)
        stream, per_step = parts.inputs(0), []
        _fsdp_param_group.foreach_all_gather = counted
        try:
            for number in (1, 2):
                gathers.append(0)
                parts.step.step(stream, lr=0.05, number=number)
                per_step.append(gathers[-1])
        finally:
            _fsdp_param_group.foreach_all_gather = original
        result[name] = {"params": {n: full(p).detach().clone() for n, p in parts.model.named_parameters()},
                        "gathers": per_step, "groups": sum(isinstance(m, FSDPModule) for m in parts.model.modules())}
    return result


def test_fsdp_reduce_step_keeps_the_weights_gathered_through_a_step_and_updates_as_ddp(tmp_path):
    """``trainer.fsdp_reduce=step``: a group's weights, once gathered in a step, stay gathered for the
    later passes (GradCache's phase 1, the replayed sub-batches' forwards and backwards) instead of
    being gathered again for each: one all-gather per group and step (7 here, against 70 with
    ``fsdp_reduce=sub_batch``; the root's weights were gathered again for every pass, 18 in all, while
    ``forward`` called the root's FSDP forward methods ``encode_*``). They are resharded after the step,
    so that the second step sees the first one's update: both steps' weights are DDP's."""
    ranks = run_ranks(2, two_steps, ["loss=infcl", "loss.tile=8"], tmp_path=tmp_path)
    for result in ranks:
        step, per_sub_batch, ddp = result["step"], result["sub_batch"], result["ddp"]
        assert step["gathers"] == [step["groups"]] * 2, (step["gathers"], step["groups"])
        assert 4 * step["gathers"][0] < per_sub_batch["gathers"][0], (step["gathers"], per_sub_batch["gathers"])
        assert ddp["gathers"] == [0, 0]
        for fsdp in (step, per_sub_batch):
            for name, value in ddp["params"].items():
                assert rel_error(fsdp["params"][name], value) <= 1e-6, name


def ddp_and_hsdp(rank: int, world: int, overrides: list[str]) -> dict:
    """The same step sharded within pairs of ranks and replicated across the pairs (HSDP), with the mesh its shards
    live on, then replicated (DDP)."""
    from torch.distributed.tensor import DTensor

    from megabatch.train.build import parts

    built, meshes = parts.RunParts.build, set()

    def recording(*args, **kwargs):
        made = built(*args, **kwargs)
        meshes.update(tuple(p.device_mesh.shape) for p in made.model.parameters() if isinstance(p, DTensor))
        return made

    parts.RunParts.build = recording
    try:
        hsdp = step_gradients(rank, world, COMMON + overrides + ["trainer.parallel=fsdp", "trainer.fsdp_shard_size=2"],
                              step=True)
    finally:
        parts.RunParts.build = built
    return {"ddp": step_gradients(rank, world, COMMON + overrides, step=True), "hsdp": hsdp, "meshes": meshes}


@pytest.mark.parametrize("overrides", [
    ["loss=local", "trainer.fsdp_reduce=step"],
    # the ring over all 4 ranks (its process group the job's, not a shard group's), a reduce-scatter per sub-batch, the
    # moving average of each rank's shards, and a teacher (sharded over the ranks, its term in the loss)
    ["loss=infcl", "loss.tile=8", "trainer.fsdp_reduce=sub_batch", "ema.decay=0.5", "distill.teacher={teacher}"],
], ids=["local-once-per-step", "ring-per-sub-batch-ema-teacher"])
def test_hsdp_on_four_ranks_gives_the_gradients_and_update_of_ddp(tmp_path, overrides):
    """``trainer.fsdp_shard_size=2`` on 4 gloo ranks: each pair holds the model in shards (a 2 x 2 mesh: 2 replicas of
    2 shards), and the step's gradients and update are DDP's."""
    if any("{teacher}" in item for item in overrides):  # another tiny CLIP's checkpoint (seed 1)
        from megabatch.config.compose import compose
        from megabatch.models import build_model

        torch.manual_seed(1)
        teacher = build_model(compose("model.text.width=48").model)
        torch.save({"model": teacher.state_dict(), "step": 0, "open_clip": teacher.description()},
                   tmp_path / "teacher.pt")
        overrides = [item.format(teacher=tmp_path / "teacher.pt") for item in overrides]
    ranks = run_ranks(4, ddp_and_hsdp, overrides, tmp_path=tmp_path)
    for result in ranks:
        ddp, hsdp = result["ddp"], result["hsdp"]
        assert result["meshes"] == {(2, 2)}
        assert hsdp["grads"].keys() == ddp["grads"].keys()
        assert rel_error(hsdp["grads"]["clip.logit_scale"], ddp["grads"]["clip.logit_scale"]) <= 1e-5
        assert rel_error(flat(hsdp["grads"]), flat(ddp["grads"])) <= 1e-5
        assert rel_error(flat(hsdp["grads"]) * 2, flat(ddp["grads"])) > 0.5  # a missed average across replicas shows
        for name, value in ddp["params"].items():
            assert rel_error(hsdp["params"][name], value) <= 1e-6, name


def test_a_shard_size_that_does_not_divide_the_ranks_names_the_key():
    from megabatch.config import ConfigError
    from megabatch.config.schema import validate
    from megabatch.train.build.parts import shard_size

    from ..helpers import compose

    assert shard_size(2, 4) == 2 and shard_size(8, 4) == 4
    with pytest.raises(ConfigError, match="trainer.fsdp_shard_size=3"):
        shard_size(3, 4)
    with pytest.raises(ConfigError, match="trainer.fsdp_shard_size"):
        validate(compose("trainer.fsdp_shard_size=0"))
