"""Checkpoints written in the background (``trainer.ckpt_async``, the default): what is written is the state at the
step it was taken, whatever the steps after it change; one write at a time; a failed write is raised; the files are
those a blocking write makes; a run killed in the middle of a write resumes from the checkpoint before it, to the
uninterrupted run's weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import megabatch.checkpoint.checkpointer as checkpointer_module
from megabatch.checkpoint.checkpointer import Checkpointer

from ..helpers import ROOT
from .test_resume import train


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def checkpointer(tmp_path, asynchronous=True):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # moments to copy
    counter = Counter()
    return Checkpointer(tmp_path, model, optimizer, {"counter": counter}, header=lambda: {"config": "c"},
                        sharded=False, keep=None, main=True, distributed=False, asynchronous=asynchronous), counter


@pytest.fixture
def gated(monkeypatch):
    """Writes that wait for ``gate`` to open (a slow disk), started ones counted in ``started``."""
    gate, started, real = threading.Event(), [], checkpointer_module.write_run_checkpoint

    def write(ckpt_dir, whole, step, numbered, keep):
        started.append(step)
        assert gate.wait(60)
        real(ckpt_dir, whole, step, numbered, keep)

    monkeypatch.setattr(checkpointer_module, "write_run_checkpoint", write)
    return gate, started


def test_a_background_write_holds_the_state_of_its_step(tmp_path, gated):
    gate, started = gated
    saver, counter = checkpointer(tmp_path)
    weight = saver.model.weight.detach().clone()
    moment = next(iter(saver.optimizer.state.values()))["exp_avg"].clone()
    counter.count = 7
    assert saver.save(1, numbered=True)  # returns while the write waits
    assert started == [1] and not (tmp_path / "last.pt").exists()
    with torch.no_grad():  # the steps after it change everything in place
        saver.model.weight.add_(1.0)
        next(iter(saver.optimizer.state.values()))["exp_avg"].add_(1.0)
    counter.count = 8
    gate.set()
    saver.wait()
    written = torch.load(tmp_path / "last.pt", weights_only=True)
    assert torch.equal(written["model"]["weight"], weight) and written["counter"] == {"count": 7}
    assert torch.equal(next(iter(written["optimizer"]["state"].values()))["exp_avg"], moment)
    assert written["step"] == 1 and (tmp_path / "step_00000001.pt").exists()
    saver.close()


def test_one_write_at_a_time_and_a_failed_one_is_raised(tmp_path, gated, monkeypatch):
    gate, started = gated
    saver, _ = checkpointer(tmp_path)
    saver.save(1, numbered=True)
    second = threading.Thread(target=saver.save, args=(2,), kwargs={"numbered": True})
    second.start()
    time.sleep(0.3)
    assert started == [1] and second.is_alive()  # the second save waits for the first write
    gate.set()
    second.join(30)
    saver.wait()
    assert started == [1, 2] and torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 2

    def full_disk(*args):
        raise OSError(28, "no space left on the disk")

    monkeypatch.setattr(checkpointer_module, "write_run_checkpoint", full_disk)
    saver.save(3, numbered=True)  # the step goes on
    with pytest.raises(OSError, match="no space left"):
        saver.wait()
    saver.close()


def test_background_and_blocking_writes_give_the_same_files(tmp_path):
    blocking = train(tmp_path / "blocking", "trainer.ckpt_async=false")
    background = train(tmp_path / "background")  # the default
    for name in ("last.pt", "step_00000002.pt"):
        one = torch.load(tmp_path / "blocking" / "checkpoints" / name, weights_only=True)
        other = torch.load(tmp_path / "background" / "checkpoints" / name, weights_only=True)
        assert one.keys() == other.keys() and one["step"] == other["step"]
        for key, value in one["model"].items():
            assert torch.equal(value, other["model"][key]), key
        states = [[value for entry in run["optimizer"]["state"].values() for _, value in sorted(entry.items())]
                  for run in (one, other)]
        assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
        torch.testing.assert_close(one["rng"], other["rng"], rtol=0, atol=0)
        assert one["train_state"] == other["train_state"]
    assert blocking["step"] == background["step"] == 4


TORN = """
import os, runpy, sys, time
from pathlib import Path
import megabatch.checkpoint.files as files
real = files._write_durably
def torn(path, write):
    if path.name.startswith(".step_00000004.pt"):  # the second checkpoint: half written, and then the run is killed
        with open(path, "wb") as handle:
            handle.write(b"x" * 4096)
        Path(os.environ["TORN_STARTED"]).touch()
        time.sleep(600)
    real(path, write)
files._write_durably = torn
sys.argv = [sys.argv[0], *sys.argv[1:]]
runpy.run_path(os.path.join(os.environ["ROOT"], "train.py"), run_name="__main__")
"""


def test_a_run_killed_mid_write_resumes_from_the_checkpoint_before(tmp_path):
    from .test_resume import TINY

    run_dir, started = tmp_path / "killed", tmp_path / "started"
    args = [*TINY, "trainer.max_steps=6", f"run_dir={run_dir}"]
    env = {**os.environ, "ROOT": str(ROOT), "TORN_STARTED": str(started)}
    job = subprocess.Popen([sys.executable, "-c", TORN, *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 240
    while not started.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), job.communicate()[0].decode()[-3000:] if job.poll() is not None else "no write began"
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and '"step": 6' not in metrics.read_text():
        time.sleep(0.05)  # the steps go on while step 4's checkpoint is written
    job.send_signal(signal.SIGKILL)
    job.communicate(timeout=60)
    checkpoints = run_dir / "checkpoints"
    assert '"step": 6' in metrics.read_text()
    assert list(checkpoints.glob(".step_00000004.pt.tmp-*"))  # the torn write, never renamed into place
    assert torch.load(checkpoints / "last.pt", weights_only=True)["step"] == 2
    resumed = train(run_dir, "trainer.max_steps=6", "resume=latest")
    straight = train(tmp_path / "straight", "trainer.max_steps=6")
    assert resumed["step"] == straight["step"] == 6
    for name, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][name]), name


def test_a_sharded_background_write_holds_the_state_of_its_step_and_is_published_by_wait(tmp_path):
    """DCP's ``async_save`` (one process): the folder appears only once ``wait`` publishes it, and holds the weights
    and moments of the step it was taken at, whatever the steps after it change."""
    from megabatch.checkpoint.files import load_checkpoint

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    counter = Counter()
    saver = Checkpointer(tmp_path, model, optimizer, {"counter": counter}, header=lambda: {"config": "c"},
                         sharded=True, keep=None, main=True, distributed=False, asynchronous=True)
    weight = model.weight.detach().clone()
    moment = next(iter(optimizer.state.values()))["exp_avg"].clone()
    counter.count = 7
    assert saver.save(1, numbered=True)
    with torch.no_grad():
        model.weight.add_(1.0)
        next(iter(optimizer.state.values()))["exp_avg"].add_(1.0)
    counter.count = 8
    saver.wait()
    assert (tmp_path / "step_00000001.dcp").is_dir() and (tmp_path / "last.dcp").is_dir()
    assert not list(tmp_path.glob(".*.tmp"))
    written = load_checkpoint(tmp_path / "step_00000001.dcp")
    assert torch.equal(written["model"]["weight"], weight) and written["counter"] == {"count": 7}
    shards = whole(tmp_path / "step_00000001.dcp", tmp_path / "whole.pt")
    assert torch.equal(shards["optimizer"]["state"]["weight"]["exp_avg"], moment)
    saver.save(2, numbered=False)  # a second write while none is in flight: published at close
    saver.close()
    assert load_checkpoint(tmp_path / "last.dcp")["counter"] == {"count": 8}


def whole(folder, path) -> dict:
    """A DCP folder's shards read into one state (the model's and the optimizer's, every tensor whole)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, path)
    return torch.load(path, weights_only=False)


def test_sharded_background_and_blocking_writes_give_the_same_checkpoints(tmp_path):
    """FSDP on 2 gloo ranks: DCP's ``async_save`` (in a gloo group of its own) writes the folders a blocking
    ``save`` writes, tensor for tensor."""
    from megabatch.checkpoint.files import load_checkpoint

    from ..distributed.test_world_size import INDEXED, finished, launch

    short = ["trainer.max_steps=4", INDEXED, "trainer.parallel=fsdp", "data.num_workers=1"]
    finished(launch(tmp_path, 2, "name=blocking", *short, "trainer.ckpt_async=false"))
    finished(launch(tmp_path, 2, "name=background", *short))
    for name in ("step_00000002.dcp", "last.dcp"):
        folders = [tmp_path / "runs" / run / "checkpoints" / name for run in ("blocking", "background")]
        one, other = (load_checkpoint(folder) for folder in folders)
        assert one["step"] == other["step"] and one["train_state"] == other["train_state"]
        one, other = (whole(folder, tmp_path / f"{index}.pt") for index, folder in enumerate(folders))
        flat = [[(key, value) for key, value in sorted(pytree_leaves(run))] for run in (one, other)]
        assert len(flat[0]) > 10 and [key for key, _ in flat[0]] == [key for key, _ in flat[1]]
        for (key, a), (_, b) in zip(*flat, strict=True):
            assert torch.equal(a, b), key


def pytree_leaves(state, prefix: str = "") -> list:
    """``(path, tensor)`` of every tensor in nested dicts."""
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        return [leaf for key, value in state.items() for leaf in pytree_leaves(value, f"{prefix}/{key}")]
    return []


def test_the_host_copies_go_into_the_buffers_of_the_last_checkpoint(tmp_path):
    """A background write's snapshot reuses the last one's host buffers (no new memory a checkpoint), and still holds
    its own step's state: the last write is on disk before they are overwritten."""
    saver, counter = checkpointer(tmp_path)
    saver.save(1, numbered=True)
    saver.wait()
    buffers = {place: tensor.data_ptr() for place, tensor in saver._snapshot.buffers.items()}
    assert len(buffers) >= 4  # the weight, the bias, and their moments
    with torch.no_grad():
        saver.model.weight.add_(1.0)
    weight = saver.model.weight.detach().clone()
    saver.save(2, numbered=True)
    saver.close()
    assert {place: tensor.data_ptr() for place, tensor in saver._snapshot.buffers.items()} == buffers
    first = torch.load(tmp_path / "step_00000001.pt", weights_only=True)
    second = torch.load(tmp_path / "step_00000002.pt", weights_only=True)
    assert torch.equal(second["model"]["weight"], weight)
    assert torch.equal(first["model"]["weight"] + 1.0, weight)


def test_resume_latest_passes_over_a_sharded_checkpoint_cut_short(tmp_path, caplog):
    """A shard file cut short (or gone) is found from the DCP metadata before anything is read: ``resume=latest``
    takes the checkpoint before, with a warning naming the file."""
    import logging
    import os

    from megabatch.checkpoint.files import load_resume

    model = torch.nn.Linear(40, 30)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    saver = Checkpointer(tmp_path / "checkpoints", model, optimizer, {}, header=lambda: {"config": "c"}, sharded=True,
                         keep=None, main=True, distributed=False)
    for step in (2, 4):
        saver.save(step, numbered=True)
    assert load_resume("latest", tmp_path)[1]["step"] == 4
    shard = max((tmp_path / "checkpoints" / "step_00000004.dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)  # last.dcp is linked to it: cut too
    with caplog.at_level(logging.WARNING):
        path, state = load_resume("latest", tmp_path)
    assert state["step"] == 2 and path.name == "step_00000002.dcp"
    assert "cut short" in caplog.text and shard.name in caplog.text
