"""An objective's own state (``Objective.state_dict``: an EMA teacher's weights, a running center) is saved in
every checkpoint under the part ``objectives`` and given back on resume: a run stopped at step 2 and resumed ends
with the state of the run that went straight through; a run whose objectives carry nothing writes no such part."""

from __future__ import annotations

import torch

from megabatch.train import run
from megabatch.train.build import parts as build_parts
from megabatch.train.step.objectives import Objective

from ..helpers import compose

TINY = ["batch=32", "trainer.max_steps=4", "trainer.log_every=1", "trainer.ckpt_every=2", "eval=none"]


class Counting(Objective):
    """A stand-in stateful objective: it counts its steps and sums each step's first feature, as a running
    statistic would."""

    name = "counting"

    def __init__(self):
        self.steps, self.total = 0, torch.zeros(())

    def new_step(self) -> None:
        self.steps += 1

    def encoded(self, sub, images, rows, total_rows, precision) -> None:
        self.total = self.total + images.float().mean().cpu()

    def state_dict(self) -> dict:
        return {"steps": self.steps, "total": self.total.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.total = state["steps"], state["total"].clone()


def train(run_dir, monkeypatch, *extra: str) -> tuple[Counting, dict]:
    made = []

    def with_counting(**kwargs):
        made.append(Counting())
        return [*build_objectives(**kwargs), made[-1]]

    build_objectives = build_parts.build_objectives
    monkeypatch.setattr(build_parts, "build_objectives", with_counting)
    cfg = compose(*TINY, "trainer.sub_batch=16", *extra)
    cfg.run_dir = str(run_dir)
    run(cfg)
    monkeypatch.setattr(build_parts, "build_objectives", build_objectives)
    return made[-1], torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def test_an_objectives_state_is_checkpointed_and_resumed(tmp_path, monkeypatch):
    straight, saved = train(tmp_path / "straight", monkeypatch)
    assert straight.steps == 4 and saved["objectives"]["counting"]["steps"] == 4
    first, _ = train(tmp_path / "resumed", monkeypatch, "trainer.stop_at_step=2")
    assert first.steps == 2
    resumed, saved = train(tmp_path / "resumed", monkeypatch, "resume=latest")
    assert resumed.steps == straight.steps == 4 and saved["objectives"]["counting"]["steps"] == 4
    assert torch.equal(resumed.total, straight.total)  # the resumed run's sum continued from the checkpoint's


def test_stateless_objectives_write_no_part(tmp_path):
    cfg = compose(*TINY, "trainer.max_steps=2")
    cfg.run_dir = str(tmp_path / "run")
    run(cfg)
    assert "objectives" not in torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
