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

    from megabatch.report import write_summary

    summary = write_summary([tmp_path], tmp_path / "report")  # a run's summary ends with its checkpoint's table
    assert "Evaluations of the last checkpoints" in summary and "| digits | zeroshot | top1 |" in summary
    assert (tmp_path / "report" / "results.csv").is_file()


def test_checkpoints_side_by_side(tmp_path, capsys):
    import importlib.util

    from megabatch.report.results import side_by_side

    first = {"imagenet": {"top1": 70.0, "top5": 90.0}, "coco": {"image_to_text_R@1": 50.0},
             "voc": {"mAP": 80.0}, "cars": {"lp_top1": 60.0, "weight_decay": 0.1}}
    second = {"imagenet": {"top1": 74.0}, "coco": {"image_to_text_R@1": 56.0}, "voc": {"mAP": 82.0}}
    for run, results in (("a", first), ("b", second)):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        write_results(tmp_path / run / "checkpoints" / "last", results)
    header, body = side_by_side({"a": first, "b": second})
    assert header == ["set", "task", "main metric", "a", "b"]
    assert body[0] == ["imagenet", "zeroshot", "top1", 70.0, 74.0]
    assert body[2] == ["voc", "zeroshot_multilabel", "mAP", 80.0, 82.0]
    assert body[3] == ["cars", "linear_probe", "lp_top1", 60.0, None]  # b has no probe
    assert body[-1][0] == "average (3 sets in every column)" and body[-1][3:] == [pytest.approx(200 / 3),
                                                                                  pytest.approx(212 / 3)]
    spec = importlib.util.spec_from_file_location("report_script", "scripts/report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    paths = [str(tmp_path / run / "checkpoints" / "last.pt") for run in ("a", "b")]
    assert report.main([*paths, "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "| set | task | main metric | a/last | b/last |" in printed
    assert "| cars | linear_probe | lp_top1 | 60.00 |  |" in printed
    assert (tmp_path / "cmp" / "results.md").read_text().count("| imagenet |") == 1
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "a" / "checkpoints" / "missing.pt"), "--out", str(tmp_path / "cmp")])
    assert "no results table beside it" in capsys.readouterr().err


def test_a_later_evaluation_of_the_same_checkpoint_joins_its_table(tmp_path):
    from megabatch.report.results import read_results

    write_results(tmp_path / "last", {"digits": {"top1": 90.0}}, step=500)
    write_results(tmp_path / "last", {"probe": {"lp_top1": 95.0}}, step=500)
    assert read_results(tmp_path / "last.results.json") == {"digits": {"top1": 90.0}, "probe": {"lp_top1": 95.0}}
    write_results(tmp_path / "last", {"digits": {"top1": 91.0}}, step=500)  # the same set again: its rows replaced
    assert read_results(tmp_path / "last.results.json")["digits"] == {"top1": 91.0}
    write_results(tmp_path / "last", {"probe": {"lp_top1": 97.0}}, step=600)  # another step: a new table
    assert read_results(tmp_path / "last.results.json") == {"probe": {"lp_top1": 97.0}}
