"""Sweeps side by side: the multirun's summary (a failed job included), report.py on a run in
progress, trainer.max_samples, TensorBoard event files read back with tensorboard's own reader."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

import pytest

from megabatch.config import ConfigError, parse_samples_total
from megabatch.config.run import RunSettings
from megabatch.config.schema import validate
from megabatch.report import read_run, write_summary
from megabatch.report.runs import RunStatus
from megabatch.train.step.plan import BatchPlan
from megabatch.train.trainer.metrics import MetricsLogger

from ..helpers import ROOT, compose

FAST = ["trainer.max_steps=null", "trainer.max_samples=192", "trainer.log_every=1", "sched.warmup_steps=1"]


def scalars(event_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard log directory, read by tensorboard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(event_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_multirun_writes_its_summary_with_a_failed_job_among_the_rows(tmp_path):
    """Three jobs: batch 32 and 64 train (192 samples each: 6 and 3 steps), batch 4096 is larger than
    the digits' training split and fails at start-up; the other jobs still run, the summary shows all
    three and the sweep ends with the failure (exit status 1), the table printed."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "batch=32,64,4096", *FAST, "name=sweep",
         "logger=[jsonl,tensorboard]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    sweep = tmp_path / "runs" / "sweep"
    assert "sweep summary" in result.stdout and "| 2 |  | 4096 | failed |" in result.stdout
    for name in ("summary.csv", "summary.md", "summary.png"):
        assert (sweep / name).stat().st_size > 0, name
    assert (sweep / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["run"], r["batch"], r["status"]) for r in rows] == [
        ("0", "32", "completed"), ("1", "64", "completed"), ("2", "4096", "failed")]
    assert [r["steps"] for r in rows[:2]] == ["6", "3"] and [r["samples seen"] for r in rows[:2]] == ["192", "192"]
    assert "larger than the training set" in rows[2]["error"]
    for row in rows[:2]:
        assert float(row["digits/top1"]) >= 0 and float(row["last loss"]) > 0 and float(row["samples/s"]) > 0
        assert row["checkpoint"].endswith("checkpoints/last.pt") and float(row["peak host GB"]) > 0
        # time_to_first_step_s from status.json: the launch (the interpreter and the imports, or the time since
        # the previous job ended) and then the run's own start-up, which wall_s (from the run's start) covers
        status = json.loads((sweep / row["run"] / "status.json").read_text())
        first, launch = float(row["first step s"]), status["startup_s"]["startup/launch_s"]
        assert first == pytest.approx(status["time_to_first_step_s"], abs=0.06) and first > launch >= 0
        assert first - launch <= float(row["wall s"]) + 0.5  # rounding (0.1 s in the table), the trainer's first lines
    assert rows[2]["first step s"] == ""  # it never stepped
    assert sorted(r["best"] for r in rows) == ["", "", "best"] and rows[2]["best"] == ""
    # the jobs' TensorBoard scalars are those of metrics.jsonl
    records = [json.loads(line) for line in (sweep / "1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "time_to_first_step_s" in r] == [records[0]["step"]]  # the first record only
    logged = scalars(sweep / "1" / "tensorboard")
    assert logged["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in records if "loss" in r]
    assert logged["eval/digits/top1"] == [(3, pytest.approx(records[-1]["eval/digits/top1"]))]


def test_report_reads_a_run_in_progress_with_a_line_cut_short(tmp_path):
    run = tmp_path / "runs" / "live"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- batch=64\n- optim.lr=0.001\n")
    (run / ".hydra" / "config.yaml").write_text("batch: 64\n")
    RunStatus(run).start()
    (run / ".lock").write_text("host 1\n")  # refreshed now: the run is alive
    lines = [{"step": 1, "time": 1.0, "loss": 4.0, "samples_per_s": 100.0, "samples_seen": 64},
             {"step": 2, "time": 2.0, "loss": 3.5, "samples_per_s": 120.0, "samples_seen": 128}]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3, "time": 3.0, "lo'
    (run / "metrics.jsonl").write_text(text)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path / "runs")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    row = read_run(run)
    assert (row.status, row.steps, row.samples_seen, row.last_loss, row.best_loss) == ("running", 2, 128, 3.5, 3.5)
    assert "| live |  | running | 2 | 128 | 3.5000 |" in result.stdout
    assert (tmp_path / "runs" / "summary.png").exists()
    old = time.time() - 600  # the lock not refreshed for 10 minutes: the process is gone
    os.utime(run / ".lock", (old, old))
    assert read_run(run).status == "interrupted"


def test_report_refuses_a_folder_without_runs(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no runs in" in result.stderr


@pytest.mark.parametrize("batch,max_samples,steps", [(32, "192", 6), (64, "192", 3), (100, "192", 2),
                                                     (1024, "12.8M", 12_500), ("32k", "12.8M", 391),
                                                     ("1M", "1B", 954)])
def test_max_samples_sets_the_steps_from_the_batch(batch, max_samples, steps):
    cfg = validate(compose(f"batch={batch}", "trainer.max_steps=null", f"trainer.max_samples={max_samples}"))
    plan = BatchPlan.of(RunSettings.of(cfg), world_size=1, num_samples=10**9)
    assert plan.total_steps == steps
    assert (steps - 1) * plan.global_batch < parse_samples_total(max_samples) <= steps * plan.global_batch


def test_max_samples_is_decimal_and_one_run_length_is_set():
    assert parse_samples_total("12.8M") == 12_800_000 and parse_samples_total("1.28B") == 1_280_000_000
    assert parse_samples_total(400000) == 400_000
    with pytest.raises(ConfigError, match="trainer.max_samples='lots'"):
        parse_samples_total("lots")
    # max_steps keeps its default: the error says so, and how to unset it
    with pytest.raises(ConfigError, match=r"\(given: trainer.max_steps=500, trainer.max_samples=1M\); e.g. "):
        validate(compose("trainer.max_samples=1M"))


def test_tensorboard_holds_the_logged_scalars_and_a_resume_hides_the_redone_steps(tmp_path):
    cfg = compose("logger=tensorboard")
    logger = MetricsLogger(tmp_path, cfg.logger)
    for step in (1, 2, 3):
        logger.log({"loss": 5.0 - step, "lr": 0.1 * step, "flag": True, "nan": float("nan")}, step=step)
    logger.close()
    logger = MetricsLogger(tmp_path, cfg.logger, resumed_step=2)  # a kill after step 3, resumed from step 2
    logger.log({"loss": 9.0}, step=3)
    logger.close()
    logged = scalars(tmp_path / "tensorboard")
    assert logged["loss"] == [(1, 4.0), (2, 3.0), (3, 9.0)] and "flag" not in logged and "nan" not in logged
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [4, 3, 9]


def test_wandb_groups_a_sweeps_jobs_under_the_sweep(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # the GPU machines' image has none

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs))
    cfg = compose("logger=[jsonl,wandb]")
    MetricsLogger(tmp_path, cfg.logger, sweep=("bs-sweep", "3"))
    MetricsLogger(tmp_path / "single", cfg.logger)
    assert (calls[0]["group"], calls[0]["name"]) == ("bs-sweep", "bs-sweep/3")
    assert (calls[1]["group"], calls[1]["name"]) == (None, "single")


def test_a_summary_of_runs_without_evaluations_ranks_by_loss(tmp_path):
    for name, losses in (("a", [3.0, 2.0]), ("b", [3.0, 1.5])):
        run = tmp_path / name
        run.mkdir()
        records = [{"step": i + 1, "time": float(i), "loss": loss, "samples_seen": 10 * (i + 1)}
                   for i, loss in enumerate(losses)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_summary([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert "| b | best |" in text and "| a |  |" in text and (tmp_path / "out" / "summary.png").exists()
