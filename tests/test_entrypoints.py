"""The entry points as a user runs them: `python train.py`, a multirun sweep, evaluate.py."""

from __future__ import annotations

import json

from .helpers import ROOT, run_script

FAST = ["batch=32", "trainer.max_steps=3", "trainer.log_every=1", "sched.warmup_steps=1"]


def test_train_smoke_then_evaluate(tmp_path):
    result = run_script(str(ROOT / "train.py"), *FAST, "name=smoke", cwd=tmp_path)
    assert "zero-shot top-1 on digits (held out)" in result.stdout
    run_dir = tmp_path / "runs" / "smoke"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert any("eval/digits/top1" in r for r in records)
    ckpt = run_dir / "checkpoints" / "last.pt"
    evaluated = run_script(str(ROOT / "scripts" / "evaluate.py"), f"ckpt={ckpt}", cwd=tmp_path)
    assert "top-1" in evaluated.stdout
    report = json.loads((run_dir / "checkpoints" / "last.eval-digits.json").read_text())
    assert report["top1"] == next(r["eval/digits/top1"] for r in records if "eval/digits/top1" in r)


def test_multirun_sweep(tmp_path):
    run_script(str(ROOT / "train.py"), "-m", *FAST, "name=sweep", "eval=none",
               "optim.lr=1e-4,1e-3", cwd=tmp_path)
    for job in ("0", "1"):
        assert (tmp_path / "runs" / "sweep" / job / "checkpoints" / "last.pt").exists()
        assert (tmp_path / "runs" / "sweep" / job / "metrics.jsonl").exists()
