"""Reliability: non-finite steps are skipped on every rank, counted, and stop the run after
trainer.max_bad_steps in a row; checkpoints stay finite; metrics.jsonl is strict JSON."""

from __future__ import annotations

import json

import pytest
import torch

from megabatch.config.schema import validate

from ..helpers import build_parts, compose, run_ranks

BASE = ["batch=16", "eval=none", "trainer.max_steps=2", "data.train.shuffle_buffer=64",
        "model.image.patch_dropout=0"]


FUSED = {False: [], True: ["+optim.optimizer.fused=true"]}  # fused: the skip is decided on the device


def moments(optimizer) -> dict:
    """AdamW's state as plain tensors (step count and moments) per parameter index."""
    return {i: {k: v.detach().clone() for k, v in state.items()}
            for i, state in enumerate(optimizer.state[p] for group in optimizer.param_groups
                                      for p in group["params"] if p in optimizer.state)}


def poisoned_step(rank: int, world: int, poison_rank: int | None, fused: bool = False,
                  good_first: bool = False) -> dict:
    """One step of the trainer's parts (after one good step with ``good_first``); ``poison_rank``'s
    gradient made NaN after DDP's average. ``fused``: AdamW fused, which skips on the device."""
    parts = build_parts(validate(compose(*BASE, *FUSED[fused])))
    assert parts.step.skips_on_device == fused
    inputs = parts.inputs(0)
    if good_first:
        parts.step.gradients(inputs)
        assert parts.step.apply().stepped
    before = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    state_before = moments(parts.optimizer)
    parts.step.gradients(inputs)
    if rank == poison_rank:
        parts.model.logit_scale.grad.fill_(float("nan"))
    applied = parts.step.apply()
    changed = any(not torch.equal(before[n], p) for n, p in parts.model.named_parameters())
    state_after = moments(parts.optimizer)
    # a fused optimizer may create its (zero) state on a skipped first step: what counts is that
    # no update is recorded in it
    state_changed = any(not torch.equal(state_before.get(i, {}).get(k, torch.zeros_like(v)), v)
                        for i, state in state_after.items() for k, v in state.items())
    return {"stepped": applied.stepped, "changed": changed, "grad_norm": applied.grad_norm,
            "state_changed": state_changed,
            "grads_cleared": all(p.grad is None for p in parts.model.parameters())}


@pytest.mark.parametrize("fused", [False, True])
def test_a_finite_step_steps_and_a_non_finite_one_is_skipped(fused):
    good = poisoned_step(0, 1, None, fused)
    assert good["stepped"] and good["changed"] and good["state_changed"] and good["grad_norm"] > 0
    for good_first in (False, True):  # the first step, and one with moments to keep
        bad = poisoned_step(0, 1, 0, fused, good_first)
        assert not bad["stepped"] and not bad["changed"] and not bad["state_changed"], good_first
        assert bad["grads_cleared"]  # the next step starts from zero gradients


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_on_one_rank_skips_the_update_on_every_rank(tmp_path, fused):
    results = run_ranks(2, poisoned_step, 1, fused, tmp_path=tmp_path)
    assert [r["stepped"] for r in results] == [False, False]
    assert not any(r["changed"] or r["state_changed"] for r in results)


@pytest.mark.parametrize("fused", [False, True])
def test_a_diverging_run_stops_with_finite_checkpoints_and_strict_metrics(tmp_path, fused):
    from megabatch.train import NonFiniteError, run

    cfg = compose("batch=32", "eval=none", "optim.lr=1e6", "trainer.max_steps=40", "trainer.log_every=1",
                  "trainer.ckpt_every=1", "trainer.keep_ckpts=null", "trainer.max_bad_steps=3",
                  "sched.warmup_steps=0", "data.train.shuffle_buffer=64", *FUSED[fused])
    cfg.run_dir = str(tmp_path)
    with pytest.raises(NonFiniteError, match="trainer.max_bad_steps=3"):
        run(cfg)

    def strict(constant):
        raise ValueError(f"not strict JSON: {constant}")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=strict) for line in lines]
    skipped = [r["skipped_steps"] for r in records]
    assert skipped[-1] == 3 and skipped == sorted(skipped)  # counted, and logged every step
    assert any(r["loss"] is None for r in records)  # a NaN loss is written as null
    checkpoints = sorted((tmp_path / "checkpoints").glob("step_*.pt"))
    assert checkpoints
    for path in checkpoints:
        state = torch.load(path, weights_only=True)
        assert all(torch.isfinite(v).all() for v in state["model"].values()), path


@pytest.mark.parametrize("target", ["os.system", "megabatch.data.offload.os.system"])
def test_a_crafted_checkpoint_runs_nothing(tmp_path, target):
    """Its stored config names a callable outside megabatch: loading it is refused before any call."""
    from megabatch.config import ConfigError
    from megabatch.eval.evaluate import evaluate_checkpoint

    marker = tmp_path / "pwned"
    config = f"model:\n  _target_: {target}\n  _args_: ['touch {marker}']\n"
    torch.save({"model": {}, "step": 0, "config": config}, tmp_path / "crafted.pt")
    cfg = compose(f"ckpt={tmp_path / 'crafted.pt'}", config_name="evaluate")
    with pytest.raises(ConfigError, match="refusing to load it"):
        evaluate_checkpoint(cfg)
    assert not marker.exists()


TINY = ["batch=32", "trainer.max_steps=6", "trainer.log_every=1", "trainer.ckpt_every=2", "trainer.keep_ckpts=null",
        "eval=none", "sched.warmup_steps=2", "data.train.shuffle_buffer=64"]


def train(run_dir, *extra: str) -> dict:
    from megabatch.train import run

    cfg = compose(*TINY, *extra)
    cfg.run_dir = str(run_dir)
    run(cfg)
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "deleted"])
def test_resume_latest_falls_back_to_the_newest_checkpoint_that_loads(tmp_path, damage, caplog):
    train(tmp_path, "trainer.stop_at_step=4")  # step_2, step_4, last (4)
    last = tmp_path / "checkpoints" / "last.pt"
    data = last.read_bytes()
    if damage == "deleted":
        last.unlink()
    else:
        last.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00junk" * 1000, "empty": b""}[damage])
    state = train(tmp_path, "resume=latest")
    assert state["step"] == 6  # continued from step_00000004.pt, not from 0
    if damage != "deleted":
        assert "skipping checkpoint" in caplog.text and "last.pt" in caplog.text


def test_no_loadable_checkpoint_is_an_error_naming_the_files(tmp_path):
    from megabatch.config import ConfigError

    train(tmp_path, "trainer.stop_at_step=2")
    for path in (tmp_path / "checkpoints").iterdir():
        path.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="last.pt.*step_00000002.pt"):
        train(tmp_path, "resume=latest")


def test_numbered_checkpoints_alone_guard_the_run_directory(tmp_path):
    from megabatch.config import ConfigError

    train(tmp_path, "trainer.stop_at_step=2")
    (tmp_path / "checkpoints" / "last.pt").unlink()
    with pytest.raises(ConfigError, match="resume=latest"):
        train(tmp_path)  # neither resume nor overwrite: step_2 must not be overwritten


def test_a_full_disk_is_named_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    import megabatch.checkpoint.files as checkpoint

    def no_space(payload, handle):
        handle.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", no_space)
    with pytest.raises(OSError, match=f"no space left on the disk of {tmp_path}"):
        checkpoint.save_checkpoint(tmp_path / "last.pt", {"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_on_a_locked_directory_fails_at_once(tmp_path):
    from megabatch.config import ConfigError
    from megabatch.train.trainer.lock import RunLock

    live = RunLock(tmp_path)  # a run of this (live) process holds the directory
    live.acquire()
    try:
        with pytest.raises(ConfigError, match=f"in use by pid {__import__('os').getpid()}"):
            train(tmp_path)
        assert not (tmp_path / "checkpoints").exists()
    finally:
        live.release()
    assert not (tmp_path / ".lock").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
    import socket
    import subprocess
    import sys

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its pid now names no process
    (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": finished.pid}))
    assert train(tmp_path, "trainer.max_steps=1")["step"] == 1
    assert "taking over" in caplog.text
    assert not (tmp_path / ".lock").exists()  # released at the end


def test_metrics_hold_each_step_once_after_a_kill_and_resume(tmp_path):
    train(tmp_path, "trainer.stop_at_step=5")  # checkpoints at 2 and 4, last.pt at 5
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "last.pt").write_bytes((checkpoints / "step_00000004.pt").read_bytes())  # killed at 5
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "loss": 1.0')  # and cut off while writing a line
    train(tmp_path, "resume=latest")
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_time_limit_stops_cleanly_with_a_checkpoint(tmp_path):
    from megabatch.train import Preempted

    with pytest.raises(Preempted, match="trainer.time_limit") as stopped:
        train(tmp_path, "trainer.max_steps=1000", "trainer.time_limit=1s")
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert 1 <= state["step"] == stopped.value.step < 1000
