"""Checkpoints: 4 steps straight equal 2 steps + resume + 2 steps, bitwise on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from megabatch.train import run

from ..helpers import compose

TINY = ["batch=32", "trainer.max_steps=4", "trainer.log_every=1", "trainer.ckpt_every=2",
        "eval=none", "sched.warmup_steps=2", "data.train.shuffle_buffer=64"]


def train(run_dir, *extra: str):
    cfg = compose(*TINY, *extra)
    cfg.run_dir = str(run_dir)
    run(cfg)
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


@pytest.mark.parametrize("loss", ["vanilla", "siglip"])
def test_resume_is_bitwise_exact(tmp_path, loss):
    straight = train(tmp_path / "straight", f"loss={loss}")
    first = train(tmp_path / "resumed", f"loss={loss}", "trainer.stop_at_step=2")
    assert first["step"] == 2
    resumed = train(tmp_path / "resumed", f"loss={loss}", "resume=latest")
    if loss == "siglip":  # the checkpoint carries the learnable bias, and it learns
        assert not torch.equal(first["model"]["clip.logit_bias"], straight["model"]["clip.logit_bias"])
    assert straight["step"] == resumed["step"] == 4
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    assert not torch.equal(first["model"]["clip.logit_scale"], straight["model"]["clip.logit_scale"])
    exp_avg = [s["exp_avg"] for s in straight["optimizer"]["state"].values()]
    exp_avg_resumed = [s["exp_avg"] for s in resumed["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, exp_avg_resumed, strict=True))
    def losses(run_dir):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [record["loss"] for record in records if "loss" in record]

    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


def test_a_resumed_run_reads_from_its_step_while_the_step_is_built(tmp_path, monkeypatch):
    """The trainer learns the step it resumes at before building the parts, so the loader's worker reads from that
    step (epoch 0, step 2 of 44) while the step is built; the sub-batches are the uninterrupted run's (the losses)."""
    from megabatch.data import TrainData
    from megabatch.train.build import parts

    straight = train(tmp_path / "straight", "data.num_workers=1")
    train(tmp_path / "resumed", "data.num_workers=1", "trainer.stop_at_step=2")
    events = []
    loader, build_step = TrainData.loader, parts.build_step

    def recorded_loader(self, epoch, start, *args, **kwargs):
        events.append(("loader", epoch, start))
        return loader(self, epoch, start, *args, **kwargs)

    def recorded_build_step(*args, **kwargs):
        events.append("step")
        return build_step(*args, **kwargs)

    monkeypatch.setattr(TrainData, "loader", recorded_loader)
    monkeypatch.setattr(parts, "build_step", recorded_build_step)
    resumed = train(tmp_path / "resumed", "data.num_workers=1", "resume=latest")
    assert events == [("loader", 0, 2), "step"], events
    assert straight["step"] == resumed["step"] == 4
    assert all(torch.equal(value, resumed["model"][name]) for name, value in straight["model"].items())
    records = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("straight", "resumed")}
    assert [r["loss"] for r in records["straight"] if "loss" in r] == \
        [r["loss"] for r in records["resumed"] if "loss" in r]


@pytest.mark.parametrize("optim", ["optim=timm optim.name=lamb", "optim=timm optim.name=lion",
                                   "optim=timm optim.name=muon",
                                   "optim=muon optim.layer_decay.image=0.8 optim.optimizer.adamw_lr=1e-3",
                                   "optim.layer_decay.image=0.8 optim.layer_decay.text=0.7"])
def test_resume_is_bitwise_exact_with_each_optimizer(tmp_path, optim):
    """timm's optimizers (LAMB; Muon, with its AdamW for what is not a matrix), torch's Muon with AdamW
    (optim=muon) and layer-wise lr decay: 2 steps + resume + 2 steps equal 4 straight, weights and optimizer state."""
    straight = train(tmp_path / "straight", *optim.split())
    train(tmp_path / "resumed", *optim.split(), "trainer.stop_at_step=2")
    resumed = train(tmp_path / "resumed", *optim.split(), "resume=latest")
    assert straight["step"] == resumed["step"] == 4
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    states = [[(key, value) for entry in run["optimizer"]["state"].values() for key, value in sorted(entry.items())
               if isinstance(value, torch.Tensor)] for run in (straight, resumed)]
    assert states[0] and [key for key, _ in states[0]] == [key for key, _ in states[1]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(*states, strict=True))
    assert [g.get("lr_scale") for g in straight["optimizer"]["param_groups"]] == \
        [g.get("lr_scale") for g in resumed["optimizer"]["param_groups"]]


def test_checkpoint_contents(tmp_path):
    state = train(tmp_path / "run", "trainer.max_steps=2")
    assert {"model", "optimizer", "step", "rng", "config"} <= state.keys()
    assert "batch: 32" in state["config"]
    assert isinstance(state["rng"]["ranks"][0]["torch"], torch.Tensor)  # every rank's RNG states
    assert state["train_state"] == {"step": 2, "samples_seen": 64} and state["step"] == 2
    assert state["data_position"]["global_batch"] == state["global_batch"] == 32
    assert state["schedule"]["total_steps"] == 2
    numbered = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert numbered == ["last.pt", "step_00000002.pt"]


def legacy_layout(state: dict, era: str) -> dict:
    """``state`` in the layout checkpoints had before each part saved its own entry (as written up to
    commit 329791b: the counters and the data position flat, every rank's RNG states a list); the
    ``oldest`` ones had no ``samples_seen`` and no ``loader_slots`` either."""
    old = {"model": state["model"], "optimizer": state["optimizer"], "step": state["step"],
           "samples_seen": state["train_state"]["samples_seen"], "global_batch": state["global_batch"],
           "loader_slots": state["data_position"]["loader_slots"], "rng": state["rng"]["ranks"],
           "config": state["config"], "open_clip": state["open_clip"]}
    if era == "oldest":
        del old["samples_seen"], old["loader_slots"]
    return old


@pytest.mark.parametrize("era", ["329791b", "oldest"])
def test_a_checkpoint_in_the_earlier_layout_resumes_bitwise(tmp_path, era, caplog):
    """A run resumed from a checkpoint of the layout before the parts had their own entries (no
    schedule entry: it starts from this run's, logged) ends with the weights and the losses of the
    run that never stopped."""
    import logging

    caplog.set_level(logging.INFO)
    straight = train(tmp_path / "straight")
    train(tmp_path / "first", "trainer.stop_at_step=2")
    old = tmp_path / "old.pt"
    torch.save(legacy_layout(torch.load(tmp_path / "first" / "checkpoints" / "step_00000002.pt",
                                        weights_only=True), era), old)
    resumed = train(tmp_path / "resumed", f"resume={old}")
    assert resumed["step"] == 4 and resumed["train_state"] == straight["train_state"]
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again if "loss" in r] == [r["loss"] for r in records if "loss" in r][2:]
    assert "has no schedule: it starts fresh" in caplog.text


def test_existing_run_is_not_overwritten(tmp_path):
    import pytest

    from megabatch.config import ConfigError

    train(tmp_path / "run", "trainer.max_steps=1")
    with pytest.raises(ConfigError, match="resume=latest"):
        train(tmp_path / "run", "trainer.max_steps=1")


def test_resume_from_a_given_path(tmp_path):
    train(tmp_path / "a", "trainer.stop_at_step=2")
    state = train(tmp_path / "b", f"resume={tmp_path / 'a' / 'checkpoints' / 'step_00000002.pt'}")
    assert state["step"] == 4


def test_sharded_checkpoints_resume_bitwise_and_a_torn_one_is_skipped(tmp_path, caplog):
    """trainer.parallel=fsdp on one process: the checkpoints are DCP folders all the same."""
    import logging

    from megabatch.checkpoint.files import _read_sharded, load_checkpoint

    caplog.set_level(logging.INFO)

    def trained(run_dir, *extra):
        cfg = compose(*TINY, "trainer.parallel=fsdp", *extra)
        cfg.run_dir = str(run_dir)
        run(cfg)
        path = run_dir / "checkpoints" / "last.dcp"
        return load_checkpoint(path), _read_sharded(path, "optimizer")

    straight, straight_optim = trained(tmp_path / "straight")
    assert sorted(p.name for p in (tmp_path / "straight" / "checkpoints").iterdir()) == [
        "last.dcp", "step_00000002.dcp", "step_00000004.dcp"]
    trained(tmp_path / "resumed", "trainer.stop_at_step=3")  # step_2.dcp, then last.dcp at step 3
    torn = tmp_path / "resumed" / "checkpoints" / "last.dcp"
    (torn / ".metadata").unlink()  # as if the writers had been killed before DCP finished
    resumed, resumed_optim = trained(tmp_path / "resumed", "resume=latest")
    assert "skipping checkpoint" in caplog.text and "incomplete" in caplog.text
    assert "resumed from" in caplog.text and "step_00000002.dcp at step 2" in caplog.text
    assert straight["step"] == resumed["step"] == 4
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    moments = list(straight_optim["state"])
    assert moments and straight_optim["state"].keys() == resumed_optim["state"].keys()
    for key in moments:
        for name, value in straight_optim["state"][key].items():
            assert torch.equal(value, resumed_optim["state"][key][name]), (key, name)


def test_resuming_a_checkpoint_of_another_model_names_the_file_and_both_shapes(tmp_path):
    """Before any training step: the file, resume, and the first mismatched tensors (issue 81)."""
    from megabatch.config import ConfigError

    train(tmp_path / "a", "trainer.max_steps=1")
    ckpt = tmp_path / "a" / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match=rf"resume='{ckpt}' does not fit this run's model: "
                                          r"clip\.positional_embedding: file \[16, 64\], model \[16, 48\]"):
        train(tmp_path / "b", f"resume={ckpt}", "model.text.width=48")
    assert not (tmp_path / "b" / "checkpoints").exists() or not any((tmp_path / "b" / "checkpoints").iterdir())


def test_a_start_that_fails_after_the_loader_began_reading_leaves_no_worker(tmp_path, monkeypatch):
    """The loader starts reading before the step is built: a build that fails after it (here the step's) stops its
    workers and says why, and the run directory's lock is released for the next try."""
    import multiprocessing

    from megabatch.train.build import parts

    def failing_build_step(*args, **kwargs):
        assert multiprocessing.active_children(), "the loader's worker was not reading yet"
        raise RuntimeError("the step could not be built")

    monkeypatch.setattr(parts, "build_step", failing_build_step)
    with pytest.raises(RuntimeError, match="the step could not be built"):
        train(tmp_path, "data.num_workers=1")
    assert not multiprocessing.active_children()
    monkeypatch.undo()
    assert train(tmp_path, "data.num_workers=1")["step"] == 4  # the lock went with the failed start
