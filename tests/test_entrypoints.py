"""The entry points as a user runs them: `python train.py`, evaluate.py (a multirun sweep: tests/report)."""

from __future__ import annotations

import json

import pytest

from .helpers import ROOT, run_script

FAST = ["batch=32", "trainer.max_steps=3", "trainer.log_every=1", "sched.warmup_steps=1"]


def test_train_smoke_then_evaluate(tmp_path):
    result = run_script(str(ROOT / "train.py"), *FAST, "name=smoke", cwd=tmp_path)
    assert "zero-shot top-1 on digits (held out)" in result.stdout
    run_dir = tmp_path / "runs" / "smoke"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert any("eval/digits/top1" in r for r in records)
    # utilisation: the tiny model's 3 x (8.5 + 2.2) MFLOP per sample at the logged speed (no peak on a CPU)
    step = next(r for r in records if "loss" in r)
    assert step["model_tflops_per_gpu"] == pytest.approx(3 * 10_691_712 * step["samples_per_s"] / 1e12)
    assert "mfu" not in step
    ckpt = run_dir / "checkpoints" / "last.pt"
    evaluated = run_script(str(ROOT / "scripts" / "evaluate.py"), f"ckpt={ckpt}", cwd=tmp_path)
    assert "top-1" in evaluated.stdout
    report = json.loads((run_dir / "checkpoints" / "last.eval-digits.json").read_text())
    assert report["top1"] == next(r["eval/digits/top1"] for r in records if "eval/digits/top1" in r)


@pytest.mark.slow  # 29 s on 2 cores: make test-all (several sets in one run: tests/eval/test_eval_ranks.py too)
def test_two_evaluation_sets_in_one_run_both_report(tmp_path):
    """``eval=[digits,retrieval]``: during training (every 2 steps and at the end) and in
    evaluate.py, each set under its own name."""
    import numpy as np

    from megabatch.data.shard_writer import encode_png

    rows = []
    for index in range(5):
        (tmp_path / f"{index}.png").write_bytes(encode_png(np.full((12, 12, 3), 40 * index, dtype=np.uint8)))
        rows.append({"image": str(tmp_path / f"{index}.png"), "captions": [f"a handwritten {index}"]})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    sets = ["eval=[digits,retrieval]", f"eval.retrieval.jsonl={tmp_path / 'pairs.jsonl'}", "eval.digits.every=2"]
    result = run_script(str(ROOT / "train.py"), *FAST, "name=two", *sets, cwd=tmp_path)
    assert "zero-shot top-1 on digits (held out)" in result.stdout and "retrieval: image_to_text_R@1" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "runs" / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/digits/top1" in r] == [2, 3]  # every 2 steps, and at the end
    assert [r["step"] for r in records if "eval/retrieval/text_to_image_R@1" in r] == [3]  # at the end only
    ckpt = tmp_path / "runs" / "two" / "checkpoints" / "last.pt"
    evaluated = run_script(str(ROOT / "scripts" / "evaluate.py"), f"ckpt={ckpt}", *sets[:2], cwd=tmp_path)
    assert "digits" in evaluated.stdout and "retrieval" in evaluated.stdout
    digits = json.loads(ckpt.with_name("last.eval-digits.json").read_text())
    retrieval = json.loads(ckpt.with_name("last.eval-retrieval.json").read_text())
    assert digits["top1"] == next(r["eval/digits/top1"] for r in records if r["step"] == 3 and "eval/digits/top1" in r)
    assert retrieval["samples"] == 5
