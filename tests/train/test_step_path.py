"""The path of one GradCache step with offload, as docs/ARCHITECTURE.md lists it, is the one the trainer runs:
traced on the tiny model (the main thread's calls into megabatch during one iteration of the run's loop that neither
logs nor checkpoints: the learning rate, the step, the hooks), every function it runs is listed there, in the order
of their first call, and the list keeps the issue's bound (at most 25 functions in at most 8 files)."""

from __future__ import annotations

import re
import sys

from megabatch.config.compose import compose

from ..helpers import ROOT

ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
SRC = ROOT / "src" / "megabatch"
# what the step calls through an interface it does not own, and does not count: the towers, the loss backends, the
# learning-rate schedules (sched=), the kernels and the collectives
NOT_COUNTED = ("models/", "losses/", "train/build/sched.py", "kernels/", "distributed/")


def traced_step(run_dir) -> list[tuple[str, str]]:
    """``(file under src/megabatch, qualified name)`` of each megabatch function the main thread runs in the third
    of four iterations of the loop (from the end of the second's last hook to the end of its own), in the order of
    their first call."""
    from megabatch.train import run

    order: list[tuple[str, str]] = []
    state = {"iterations": 0, "on": False}
    prefix = str(SRC) + "/"

    def note(code) -> None:
        name = (code.co_filename.removeprefix(prefix), code.co_qualname)
        if name not in order and "<" not in code.co_qualname and not name[0].startswith(NOT_COUNTED):
            order.append(name)

    def profile(frame, event, arg):
        code = frame.f_code
        if state["on"] and event == "call" and code.co_qualname == "TrainStep.step":
            note(frame.f_back.f_code)  # the loop that called it
        if state["on"] and event == "call" and code.co_filename.startswith(prefix):
            note(code)
        if event == "return" and code.co_qualname == "Trainer.stop_if_asked":  # an iteration's last hook
            state["iterations"] += 1
            state["on"] = state["iterations"] == 2

    cfg = compose("model=tiny", "batch=16", "trainer.sub_batch=4", "trainer.offload=true", "trainer.max_steps=4",
                  "eval=none", "data.num_workers=2", "trainer.ckpt_every=null", "trainer.log_every=1000")
    cfg.run_dir = str(run_dir)
    sys.setprofile(profile)
    try:
        run(cfg)
    finally:
        sys.setprofile(None)
    return order


def documented(section: str) -> list[tuple[str, str]]:
    """The ``| n | `function` | file |`` rows of the table under ``section`` in ARCHITECTURE.md."""
    text = ARCHITECTURE.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    table = text.split("\n\n| ", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in ("| " + table).splitlines():
        found = re.match(r"\|\s*\d+\s*\|\s*`([^`]+)`\s*\|\s*([\w/.]+\.py)\s*\|", line)
        if found:
            rows.append((found.group(2), found.group(1)))
    return rows


def test_the_documented_step_path_is_the_one_the_trainer_runs(tmp_path):
    path = documented("The path of one GradCache step with offload")
    traced = traced_step(tmp_path / "run")
    assert len(path) <= 25 and len({file for file, _ in path}) <= 8, path  # the bound
    undocumented = [name for name in traced if name not in path]
    assert not undocumented, f"run by the step but not in docs/ARCHITECTURE.md: {undocumented}"
    not_run = [name for name in path if name not in traced]
    assert not not_run, f"listed in docs/ARCHITECTURE.md but not run by the step: {not_run}"
    assert traced == path, "the path's functions run in another order than docs/ARCHITECTURE.md lists them"
