"""checkpoint.py's file handling: a numbered checkpoint and last.pt from one serialisation, and the
RNG states it captures restored whole."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from megabatch.checkpoint import capture_rng, load_checkpoint, restore_rng, write_run_checkpoint


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
