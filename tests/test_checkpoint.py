"""checkpoint/files.py's file handling: a numbered checkpoint and last.pt from one serialisation, and the
RNG states it captures restored whole."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from megabatch.checkpoint.files import capture_rng, load_checkpoint, restore_rng, write_run_checkpoint


def test_a_numbered_checkpoint_and_last_pt_are_one_file_until_the_next_save(tmp_path, monkeypatch):
    saves = []
    original = torch.save
    monkeypatch.setattr(torch, "save", lambda *args, **kwargs: (saves.append(1), original(*args, **kwargs))[1])
    write_run_checkpoint(tmp_path, {"model": {}, "step": 2}, step=2, numbered=True, keep=2)
    assert len(saves) == 1  # serialised once
    assert os.path.samefile(tmp_path / "last.pt", tmp_path / "step_00000002.pt")
    write_run_checkpoint(tmp_path, {"model": {}, "step": 3}, step=3, numbered=False, keep=2)
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 3
    assert load_checkpoint(tmp_path / "step_00000002.pt")["step"] == 2  # a rename replaced last.pt, not a write
    for step in (4, 6):
        write_run_checkpoint(tmp_path, {"model": {}, "step": step}, step=step, numbered=True, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step_00000004.pt", "step_00000006.pt"]
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 6


def test_rng_states_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(state)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])
    assert set(state) <= {"python", "numpy", "numpy_pos", "torch", "cuda"}


class Counter:
    """A part of a run with a state of its own (as EMA weights or a teacher's settings would be)."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state: dict) -> None:
        self.value = int(state["value"])


def test_a_new_part_is_one_entry_saved_and_resumed_by_the_checkpointer(tmp_path, caplog):
    """Each part saves and loads its own state under its name; a file written before a part existed
    leaves that part fresh (logged, unless the part never has a state: a disabled scaler), and a weight that is not
    finite writes nothing."""
    import logging

    from megabatch.checkpoint.checkpointer import Checkpointer, TrainState

    caplog.set_level(logging.INFO)

    def checkpointer(folder, model, parts):
        optimizer = torch.optim.AdamW(model.parameters())
        return Checkpointer(folder, model, optimizer, parts, header=lambda: {"config": "x: 1"}, sharded=False,
                            keep=None, main=True, distributed=False), optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    state, counter = TrainState(step=5, samples_seen=40), Counter(7)
    saver, _ = checkpointer(tmp_path, model, {"train_state": state, "ema": counter})
    assert saver.save(5, numbered=True) and saver.saved_step == 5
    restored, fresh = TrainState(), Counter()
    loader, _ = checkpointer(tmp_path, torch.nn.Linear(3, 2), {"train_state": restored, "ema": fresh})
    loader.load(tmp_path / "last.pt", load_checkpoint(tmp_path / "last.pt"))
    assert (restored.step, restored.samples_seen, fresh.value) == (5, 40, 7)
    assert torch.equal(loader.model.weight, model.weight)
    older = tmp_path / "older"
    checkpointer(older, model, {"train_state": state})[0].save(5, numbered=False)
    later = Counter(3)
    checkpointer(older, model, {"train_state": TrainState(), "ema": later})[0].load(
        older / "last.pt", load_checkpoint(older / "last.pt"))
    assert later.value == 3 and "has no ema: it starts fresh" in caplog.text
    # a disabled scaler (fp32 and bf16 runs) saves nothing, and its absence is not logged; an fp16 run's is
    for enabled in (False, True):
        caplog.clear()
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        checkpointer(older, model, {"train_state": TrainState(), "scaler": scaler})[0].load(
            older / "last.pt", load_checkpoint(older / "last.pt"))
        assert ("has no scaler" in caplog.text) == enabled
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert not saver.save(6, numbered=True) and saver.saved_step == 5
    assert not (tmp_path / "step_00000006.pt").exists()
