"""One results table per checkpoint (eval/results.py): every set's metrics as rows, written as CSV and
JSON beside the checkpoint with the main metrics' average, by scripts/evaluate.py and at a run's end."""

from __future__ import annotations

import csv
import json

import pytest

from megabatch.eval.results import results_rows, results_table, write_results


def test_rows_table_and_files(tmp_path):
    results = {"imagenet": {"top1": 70.0, "top5": 90.0, "samples": 50000, "step": 5, "ckpt": "x", "weights": "raw"},
               "coco": {"image_to_text_R@1": 50.0, "text_to_image_R@1": 40.0, "samples": 5000},
               "imagenet-ema": {"top1": 72.0, "top5": 91.0, "samples": 50000}}
    rows = results_rows(results)
    assert rows[0] == {"set": "imagenet", "task": "zeroshot", "metric": "top1", "value": 70.0}
    assert [(r["set"], r["metric"]) for r in rows if r["set"] == "coco"] == [
        ("coco", "image_to_text_R@1"), ("coco", "text_to_image_R@1")]  # no bookkeeping rows
    table = results_table(results)
    assert "| coco | retrieval | image_to_text_R@1 | 50.00 |" in table and "| average | | | 64.00 |" in table
    csv_path, json_path = write_results(tmp_path / "last", results)
    assert csv_path.name == "last.results.csv" and json_path.name == "last.results.json"
    with open(csv_path) as handle:
        assert [dict(r, value=float(r["value"])) for r in csv.DictReader(handle)] == rows
    assert json.loads(json_path.read_text())["average_main_metric"] == pytest.approx(64.0)


def test_a_run_writes_the_last_checkpoints_table(tmp_path):
    from megabatch.train import run

    from ..helpers import compose

    cfg = compose("batch=32", "trainer.max_steps=2", "data.train.shuffle_buffer=64")
    cfg.run_dir = str(tmp_path)
    run(cfg)
    rows = json.loads((tmp_path / "checkpoints" / "last.results.json").read_text())["rows"]
    assert {(r["set"], r["metric"]) for r in rows} == {("digits", "top1"), ("digits", "top5"),
                                                        ("digits", "mean_per_class_recall")}
