"""Distillation through the trainer's step (``distill.teacher``): a frozen teacher (a megabatch checkpoint of
another tiny CLIP) encoded in GradCache's first pass gives, with sub-batches, offload and on 2 gloo ranks, the
one-pass step's gradients; the teacher never receives a gradient and is not in the optimizer; a run logs both
terms; bad settings are config errors naming the key. (The loss itself against float64 and OpenCLIP's
``DistillClipLoss``: tests/losses/test_distill.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.cli import quote_patterns
from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.distributed.fsdp import full, is_sharded
from megabatch.models import build_model
from megabatch.train.build.parts import RunParts

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
                           *([f"distill.teacher={teacher}"] if teacher else []), *quote_patterns(list(overrides))))
    parts = RunParts.build(cfg, init_distributed("cpu"))
    loss, _ = parts.step.gradients(parts.inputs(0))
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    result = {"loss": loss, "grads": grads, "terms": dict(getattr(parts.step.loss_fn, "terms", {}))}
    held = parts.step.teacher
    if held is not None and held.model is not None:
        optimized = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
        result["teacher_grads"] = sum(p.grad is not None for p in held.model.parameters())
        result["teacher_in_optimizer"] = sum(id(p) in optimized for p in held.model.parameters())
        result["teacher_trainable"] = sum(p.requires_grad for p in held.model.parameters())
        # its weights sharded (FSDP's DTensors, each rank a part) or whole
        result["teacher_sharded"] = is_sharded(held.model)
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


def test_the_fused_kernels_give_the_torch_blocks_step_on_either_path(teacher, monkeypatch):
    """``loss.impl=triton`` (the fused distillation kernels, interpreted here): the one-pass step and GradCache's
    sub-batches, with and without offload, give the torch blocks' loss and gradients. The kernels' pass writes the
    gradients in the loss's forward, which GradCache's phase 2 and the one-pass step's backward both take."""
    from megabatch.kernels import triton_tiles

    reference = gradients(teacher)
    fused = ["loss.impl=triton", "loss.fp32_precision=ieee"]
    passes = []
    block = triton_tiles.distill_block
    monkeypatch.setattr(triton_tiles, "distill_block", lambda *a, **k: passes.append(1) or block(*a, **k))
    sub_batches = f"trainer.sub_batch={BATCH // 4}"
    for extra in ([], [sub_batches], [sub_batches, "trainer.offload=true"]):
        passes.clear()
        got = gradients(teacher, *fused, *extra)
        assert passes  # the fused kernels ran
        assert set(got["terms"]) == {"contrastive", "distill"}
        assert rel_error(got["loss"], reference["loss"]) <= 1e-6, extra
        assert rel_error(flat(got["grads"]), flat(reference["grads"])) <= 1e-5, extra
        assert rel_error(got["grads"]["clip.logit_scale"], reference["grads"]["clip.logit_scale"]) <= 1e-5, extra


def two_ranks(rank: int, world: int, teacher: str) -> dict:
    results = {}
    for parallel in ("ddp", "fsdp"):
        result = gradients(teacher, "trainer.sub_batch=4", f"trainer.parallel={parallel}", loss="disco")
        results[parallel] = {k: result[k] for k in ("loss", "grads", "teacher_grads", "teacher_in_optimizer")}
        results[parallel]["teacher_sharded"] = result["teacher_sharded"]
    # the fused kernels (interpreted): each rank's rows against every rank's columns, the gradients written in the
    # loss's forward, under DDP
    fused = gradients(teacher, "trainer.sub_batch=4", "trainer.parallel=ddp", "loss.impl=triton",
                      "loss.fp32_precision=ieee")
    results["ddp, fused kernels"] = {k: fused[k] for k in ("loss", "grads", "teacher_grads", "teacher_in_optimizer")}
    results["ddp, fused kernels"]["teacher_sharded"] = fused["teacher_sharded"]
    return results


def test_two_ranks_equal_one_process(teacher, tmp_path):
    """DDP and FSDP (the teacher sharded too: each rank holds half of its weights) on 2 ranks, and DDP with the fused
    kernels: one process's loss and gradients; the teacher frozen either way."""
    single = gradients(teacher, loss="disco")
    for result in run_ranks(2, two_ranks, teacher, tmp_path=tmp_path):
        for parallel, ranked in result.items():
            assert rel_error(ranked["loss"], single["loss"]) <= 1e-6, parallel
            assert rel_error(flat(ranked["grads"]), flat(single["grads"])) <= 1e-5, parallel
            assert ranked["teacher_grads"] == ranked["teacher_in_optimizer"] == 0, parallel
            assert ranked["teacher_sharded"] == (parallel == "fsdp"), parallel


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
    with pytest.raises(ConfigError, match=r"distill\.compile='maybe'.*as model\.compile"):
        validate(compose("distill.compile=maybe"))
    with pytest.raises(ConfigError, match=r"distill\.pretrained=.* without distill\.teacher"):
        validate(compose("distill.pretrained=/x.pt"))
    with pytest.raises(ConfigError, match=r"distill\.teacher=stored reads .* set data\.train\.teacher_key"):
        validate(compose("distill.teacher=stored"))
    with pytest.raises(ConfigError, match=r"data\.train\.teacher_key=teacher\.npy is read only with distill"):
        validate(compose("data.train.teacher_key=teacher.npy"))
    with pytest.raises(ConfigError, match=r"data\.train\.teacher_key=teacher\.npy: .*teacher\.json does not exist"):
        RunParts.build(validate(compose(*BASE, *STORED)), init_distributed("cpu"))  # the digits: none written
    with pytest.raises(ConfigError, match=r"distill\.teacher='no-such-model' is neither"):
        RunParts.build(validate(compose(*BASE, "distill.teacher=no-such-model")), init_distributed("cpu"))
    with pytest.raises(ConfigError, match=r"distill\.teacher=.*README\.md.*cannot be loaded"):
        RunParts.build(validate(compose(*BASE, f"distill.teacher={ROOT / 'README.md'}")), init_distributed("cpu"))
    with pytest.raises(ConfigError, match=r"distill\.pretrained=.* drop distill\.pretrained"):
        RunParts.build(validate(compose(*BASE, f"distill.teacher={teacher}", f"distill.pretrained={teacher}")),
                       init_distributed("cpu"))



AUGMENT_OFF = ["data.train.augment.scale=[1.0,1.0]", "data.train.augment.ratio=[1.0,1.0]"]  # the whole 32 px scan
STORED = ["distill.teacher=stored", "data.train.teacher_key=teacher.npy"]


def make_teacher_shards(pattern: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/make_shards.py", "teacher", pattern, "--out", str(out),
                           "--batch", "100", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def stored(teacher, tmp_path_factory) -> dict:
    """The digits' training shards copied with the teacher's embeddings (float32, and float16), as
    ``scripts/make_shards.py teacher`` writes them."""
    from megabatch.data.digits import ensure_digits

    pattern = ensure_digits(compose().data.cache_dir)["train"]
    folder = tmp_path_factory.mktemp("stored")
    # float32 as users run it; float16 (the default) in this process
    made = make_teacher_shards(pattern, folder / "float32", "--teacher", teacher, "--dtype", "float32")
    assert made.returncode == 0, made.stderr[-3000:]
    script().main(["teacher", pattern, "--out", str(folder / "float16"), "--teacher", teacher])
    return {dtype: str(folder / dtype / Path(pattern).name) for dtype in ("float32", "float16")}


def script():
    """scripts/make_shards.py as a module (its main() called in this process: no interpreter start-up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_shards", ROOT / "scripts" / "make_shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stored_embeddings_give_the_online_teachers_gradients(teacher, stored, capsys):
    online = gradients(teacher, *AUGMENT_OFF)
    exact = gradients(None, *AUGMENT_OFF, *STORED, f"data.train.urls={stored['float32']}")
    assert set(exact["terms"]) == {"contrastive", "distill"}
    assert rel_error(exact["loss"], online["loss"]) <= 1e-6
    assert rel_error(flat(exact["grads"]), flat(online["grads"])) <= 1e-5
    half = gradients(None, *AUGMENT_OFF, *STORED, f"data.train.urls={stored['float16']}")
    assert 0 < rel_error(flat(half["grads"]), flat(online["grads"])) <= 1e-2  # fp16 embeddings: rounded
    # written again into the same folder: the shards there are kept; other teachers there are refused
    folder = Path(stored["float32"]).parent
    script().main(["teacher", stored["float32"], "--out", str(folder), "--teacher", teacher])
    assert "wrote 0 shard(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script().main(["teacher", stored["float32"], "--out", str(folder), "--teacher", teacher, "--teacher", teacher])
    assert "describes other teachers" in capsys.readouterr().err


def test_samples_without_or_with_bad_embeddings_are_skipped_and_counted(stored, tmp_path):
    import shutil

    import numpy as np

    from megabatch.data.teacher_store import encode_embeddings

    from ..helpers import rewrite_members, sample_keys

    source = Path(stored["float32"]).parent
    for path in source.iterdir():
        shutil.copy(path, tmp_path / path.name)
    first = sorted(tmp_path.glob("*.tar"))[0]
    keys = sample_keys(first)
    another_width = encode_embeddings(np.zeros((1, 2, 7), np.float32))
    rewrite_members(first, {f"{keys[0]}.teacher.npy": None, f"{keys[1]}.teacher.npy": another_width})  # none; wrong
    parts = RunParts.build(validate(compose(*BASE, "loss=infcl", *STORED, *quote_patterns(
                               [f"data.train.urls={tmp_path / Path(stored['float32']).name}"]))),
                           init_distributed("cpu"))
    sub = next(parts.inputs(0))
    assert sub.teacher is not None and sub.teacher.shape[1:] == (1, 2, 64)
    assert sub.stats["missing_teacher"] == 1 and sub.stats["bad_teacher"] == 1
    parts.close()
