"""Distillation through the trainer's step (``distill.teacher``): a frozen teacher (a megabatch checkpoint of
another tiny CLIP) encoded in GradCache's first pass gives, with sub-batches, offload and on 2 gloo ranks, the
one-pass step's gradients; the teacher never receives a gradient and is not in the optimizer; a run logs both
terms; bad settings are config errors naming the key. (The loss itself against float64 and OpenCLIP's
``DistillClipLoss``: tests/losses/test_distill.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.distributed.fsdp import full
from megabatch.models import build_model
from megabatch.train.parts import RunParts

from ..helpers import ROOT, compose, rel_error, run_ranks
from .test_gradcache import BASE, BATCH, flat


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A checkpoint of a tiny CLIP with other weights than the student's (seed 1), as a run writes one."""
    torch.manual_seed(1)
    model = build_model(compose("model.text.width=48").model)  # another width than the student's
    path = tmp_path_factory.mktemp("teacher") / "teacher.pt"
    torch.save({"model": model.state_dict(), "step": 0, "open_clip": model.description()}, path)
    return str(path)


def gradients(teacher: str | None, *overrides: str, loss: str = "infcl") -> dict:
    cfg = validate(compose(*BASE, f"loss={loss}", *(["loss.tile=8"] if loss == "infcl" else []),
                           "model.image.patch_dropout=0",
                           *([f"distill.teacher={teacher}"] if teacher else []), *overrides))
    parts = RunParts.build(cfg, init_distributed("cpu"))
    loss, _ = parts.step.gradients(parts.inputs(0))
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    result = {"loss": loss, "grads": grads, "terms": dict(parts.step.loss_fn.terms) if teacher else {}}
    held = parts.step.teacher
    if held is not None:
        optimized = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
        result["teacher_grads"] = sum(p.grad is not None for p in held.model.parameters())
        result["teacher_in_optimizer"] = sum(id(p) in optimized for p in held.model.parameters())
        result["teacher_trainable"] = sum(p.requires_grad for p in held.model.parameters())
    parts.close()
    return result


def test_sub_batches_and_offload_give_the_one_pass_gradients_and_the_teacher_stays_frozen(teacher):
    one_pass = gradients(teacher)
    assert set(one_pass["terms"]) == {"contrastive", "distill"}
    for extra in ([f"trainer.sub_batch={BATCH // 4}"], [f"trainer.sub_batch={BATCH // 4}", "trainer.offload=true"]):
        cached = gradients(teacher, *extra)
        assert rel_error(cached["loss"], one_pass["loss"]) <= 1e-6, extra
        assert rel_error(flat(cached["grads"]), flat(one_pass["grads"])) <= 1e-5, extra
        assert rel_error(cached["grads"]["clip.logit_scale"], one_pass["grads"]["clip.logit_scale"]) <= 1e-5
        assert cached["teacher_grads"] == cached["teacher_in_optimizer"] == cached["teacher_trainable"] == 0
    # not vacuous: the teacher's term changes the loss and the gradients
    plain = gradients(None)
    assert rel_error(one_pass["terms"]["contrastive"], plain["loss"]) <= 1e-6
    assert rel_error(flat(plain["grads"]), flat(one_pass["grads"])) > 1e-3


def two_ranks(rank: int, world: int, teacher: str) -> dict:
    return gradients(teacher, "trainer.sub_batch=4", loss="disco")


def test_two_ranks_equal_one_process(teacher, tmp_path):
    single = gradients(teacher, loss="disco")
    for result in run_ranks(2, two_ranks, teacher, tmp_path=tmp_path):
        assert rel_error(result["loss"], single["loss"]) <= 1e-6
        assert rel_error(flat(result["grads"]), flat(single["grads"])) <= 1e-5


def test_a_run_logs_both_terms(teacher, tmp_path):
    ran = subprocess.run([sys.executable, "train.py", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=2",
                          "batch=32", "trainer.sub_batch=16", "trainer.log_every=1", "eval=none",
                          f"distill.teacher={teacher}", "distill.weight=0.5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "distill: teacher tiny" in ran.stdout and "(contrastive " in ran.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/distill" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["loss"] == pytest.approx(record["loss/contrastive"] + 0.5 * record["loss/distill"], rel=1e-5)


def test_bad_settings_are_config_errors_naming_the_key(teacher, tmp_path):
    with pytest.raises(ConfigError, match=r"distill\.teacher with loss=siglip"):
        validate(compose("loss=siglip", f"distill.teacher={teacher}"))
    with pytest.raises(ConfigError, match=r"distill\.weight=-1"):
        validate(compose("distill.weight=-1"))
    with pytest.raises(ConfigError, match=r"distill\.temperature=0"):
        validate(compose("distill.temperature=0"))
    with pytest.raises(ConfigError, match=r"distill\.pretrained=.* without distill\.teacher"):
        validate(compose("distill.pretrained=/x.pt"))
    with pytest.raises(ConfigError, match=r"distill\.teacher='no-such-model' is neither"):
        RunParts.build(validate(compose(*BASE, "distill.teacher=no-such-model")), init_distributed("cpu"))
    with pytest.raises(ConfigError, match=r"distill\.teacher=.*README\.md.*cannot be loaded"):
        RunParts.build(validate(compose(*BASE, f"distill.teacher={ROOT / 'README.md'}")), init_distributed("cpu"))
    with pytest.raises(ConfigError, match=r"distill\.pretrained=.* drop distill\.pretrained"):
        RunParts.build(validate(compose(*BASE, f"distill.teacher={teacher}", f"distill.pretrained={teacher}")),
                       init_distributed("cpu"))
