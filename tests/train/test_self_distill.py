"""``self_distill``: SigLIP 2's late terms (SILC's local-to-global self-distillation, TIPS's masked prediction). The
contract (one pass, GradCache, offload, 2 ranks: the same loss and gradients) is
``test_objectives_contract.py``'s rows and FSDP's case in ``tests/distributed/test_fsdp.py``; here the views'
draws, the start step, the EMA teacher and the centers over steps on 2 DDP ranks, the checkpointed state, and the
config's errors."""

from __future__ import annotations

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.models import build_model
from megabatch.models.openclip import from_description
from megabatch.models.views import ViewsCfg
from megabatch.train.build.parts import RunParts
from megabatch.train.step.objectives import SelfDistillation

from ..helpers import compose, run_ranks
from .test_gradcache import BASE
from .test_objectives_contract import SELF_DISTILL

VIEWS = ViewsCfg(local_crops=3, local_size=16, prototypes=32, hidden=32, bottleneck=16)


def tiny_with_views():
    torch.manual_seed(0)
    model = build_model(compose().model)
    model.attach_views(VIEWS)
    return model


def test_the_views_come_from_the_image_and_the_step_not_its_place_in_the_batch():
    model = tiny_with_views()
    heads = model.views
    images = torch.randint(0, 255, (6, 3, 32, 32), dtype=torch.uint8)
    seeds = heads.seeds(images)
    again = heads.seeds(images.flip(0)).flip(0)  # the same images in another order
    assert torch.equal(seeds, again)
    assert torch.equal(heads.masked_positions(seeds[2:4]), heads.masked_positions(seeds)[2:4])
    positions = heads.masked_positions(seeds)
    assert positions.shape == (6, 8)  # half of the 4 x 4 patches
    assert all(len(set(row.tolist())) == 8 for row in positions)  # distinct, and not all the same rows
    assert len({tuple(row.tolist()) for row in positions}) > 1
    floats = images.float()
    crops = heads.crops(floats, seeds)
    assert crops.shape == (18, 3, 16, 16)
    torch.testing.assert_close(heads.crops(floats[3:5], seeds[3:5]), crops[9:15], rtol=0, atol=0)
    heads.step.fill_(1)  # another step: other views
    assert not torch.equal(heads.masked_positions(heads.seeds(images)), positions)
    # a crop of a constant image is that constant (resampled inside it)
    flat = torch.full((1, 3, 32, 32), 7.0)
    torch.testing.assert_close(heads.crops(flat, seeds[:1]), torch.full((3, 3, 16, 16), 7.0))


def test_the_student_reads_its_views_through_the_tower_and_the_description_rebuilds_the_heads():
    model = tiny_with_views()
    images = torch.randint(0, 255, (4, 3, 32, 32), dtype=torch.uint8)
    texts = torch.zeros((4, 16), dtype=torch.long)
    outputs = model(images, texts, views=True)
    student = outputs[4]["views"]
    assert student["crops"].shape == (4, 3, 32) and student["masked"].shape == (4, 8, 32)
    plain = model(images, texts)
    torch.testing.assert_close(outputs[0], plain[0], rtol=0, atol=0)  # the features are the plain forward's
    rebuilt = from_description(model.description())
    rebuilt.load_state_dict(model.state_dict())  # strict: views.* are there
    torch.testing.assert_close(rebuilt(images, texts, views=True)[4]["views"]["masked"], student["masked"])


def late_steps(rank: int, world: int) -> dict:
    """Three optimizer steps with the late terms from step 1 (``start=0.5`` of 3) on this rank: each step's terms,
    the heads' gradient at step 0, the teacher against the student, the centers, and a resumed objective's state."""
    cfg = validate(compose(*BASE, "model.image.patch_dropout=0", "trainer.max_steps=3", "trainer.sub_batch=4",
                           *SELF_DISTILL, "self_distill.start=0.5", "self_distill.teacher_momentum=0.5"))
    parts = RunParts.build(cfg, init_distributed("cpu"))
    step, stream = parts.step, parts.inputs(0)
    late = next(objective for objective in step.objectives if isinstance(objective, SelfDistillation))
    student = dict(parts.model.clip.visual.named_parameters(prefix="visual"))
    student.update(parts.model.views.named_parameters(prefix="heads"))

    def teacher() -> dict:
        return dict(late.teacher.named_parameters())

    seen = {"terms": [], "start_step": late.start_step}
    for number in range(3):
        before = {name: param.detach().clone() for name, param in student.items()}
        teacher_before = {name: t.detach().clone() for name, t in teacher().items()}
        loss, _ = step.gradients(stream)
        seen["terms"].append(sorted(step.contrastive.terms) if late.active else [])
        if number == 0:
            seen["head_grads"] = max(float(p.grad.abs().max()) for p in parts.model.views.parameters())
        if number == 1:  # the teacher is the student as the step began
            seen["copied"] = max(float((teacher()[name] - before[name]).abs().max()) for name in before)
            seen["center"] = float(late.center.abs().max())
        if number == 2:  # halfway from the teacher to the student (momentum 0.5)
            seen["moved"] = max(float((teacher()[name] - (teacher_before[name] + before[name]) / 2)
                                      .abs().max()) for name in before)
        step.apply()
    state = late.state_dict()
    fresh = SelfDistillation(parts.model, late.settings, late.start_step, step.precision)
    fresh.load_state_dict(state)
    seen["resumed"] = max(float((dict(fresh.teacher.named_parameters())[name] - t).abs().max())
                          for name, t in teacher().items())
    seen["resumed_steps"] = (fresh.steps, fresh.started, bool(torch.equal(fresh.center, late.center)))
    seen["teacher_sum"] = float(sum(t.double().sum() for t in teacher().values()))
    parts.close()
    return seen


def test_the_late_terms_start_at_their_step_and_the_teacher_follows_the_student_on_two_ranks(tmp_path):
    ranks = run_ranks(2, late_steps, tmp_path=tmp_path)
    for seen in ranks:
        assert seen["start_step"] == 1
        assert seen["terms"][0] == []  # before the start: no views, no terms
        assert seen["terms"][1] == seen["terms"][2] == ["contrastive", "masked", "self_distill"]
        assert seen["head_grads"] == 0.0  # the heads were used (DDP's buckets) and learned nothing
        assert seen["copied"] == 0.0
        assert seen["center"] > 0
        assert seen["moved"] <= 1e-6
        assert seen["resumed"] == 0.0 and seen["resumed_steps"] == (3, True, True)
    assert ranks[0]["teacher_sum"] == ranks[1]["teacher_sum"]  # the ranks' teachers agree


@pytest.mark.parametrize("override, key", [
    ("self_distill.mask_ratio=1.5", "self_distill.mask_ratio"),
    ("self_distill.start=1", "self_distill.start"),
    ("self_distill.crop_scale=[0.5,0.1]", "self_distill.crop_scale"),
    ("self_distill.teacher_temp=0", "self_distill.teacher_temp"),
    ("self_distill.local_crops=0", "self_distill.local_crops"),
    ("model.lock_image=true", "self_distill"),
])
def test_a_bad_self_distill_setting_names_its_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose("self_distill.weight=1.0", override))


def test_the_crops_must_be_whole_patches():
    model = build_model(compose().model)
    with pytest.raises(ConfigError, match=r"self_distill\.local_size=20"):
        model.attach_views(ViewsCfg(local_size=20))


def test_the_heads_are_not_decayed_before_the_late_terms_start():
    """AdamW's decoupled weight decay (optim=adamw, 0.2) would shrink the heads through every step before the start
    (their gradient is zero there); their groups' decay is held at 0 until the terms train them."""
    cfg = validate(compose(*BASE, "optim=adamw", "model.image.patch_dropout=0", "trainer.max_steps=2",
                           "trainer.sub_batch=4", *SELF_DISTILL, "self_distill.start=0.5"))
    parts = RunParts.build(cfg, init_distributed("cpu"))
    step, stream = parts.step, parts.inputs(0)
    owned = [group for group in step.optimizer.param_groups if group.get("owner") == "views."]
    heads = list(parts.model.views.parameters())
    assert {id(p) for group in owned for p in group["params"]} == {id(p) for p in heads}
    assert max(group["decay"] for group in owned) == 0.2
    visual = parts.model.clip.visual.proj
    before, visual_before = [p.detach().clone() for p in heads], visual.detach().clone()
    step.gradients(stream)
    step.apply()  # step 0: before the start
    assert all(torch.equal(p, b) for p, b in zip(heads, before, strict=True))  # neither trained nor decayed
    assert not torch.equal(visual, visual_before)
    assert all(group["weight_decay"] == 0.0 for group in owned)
    step.gradients(stream)
    step.apply()  # step 1: the terms train the heads, and decay them
    assert not any(torch.equal(p, b) for p, b in zip(heads, before, strict=True))
    assert all(group["weight_decay"] == group["decay"] for group in owned)
    parts.close()
