"""Evaluation tables read back and put side by side: each set's task and main metric, told by the metrics its
result has; a checkpoint's ``<ckpt>.results.json`` (written by ``eval/results.py``); several checkpoints' tables as
one (``scripts/report.py``, and a sweep's summary)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

TASKS = {  # a result's task, told by the metric only it has, and that task's main metric
    "top1": ("zeroshot", "top1"),
    "mAP": ("zeroshot_multilabel", "mAP"),
    "lp_top1": ("linear_probe", "lp_top1"),
    "dense_miou": ("dense_probe", "dense_miou"),
    "cider": ("captioning", "cider"),
    "acc": ("image_caption_selection", "acc"),
    "image_to_text_R@1": ("retrieval", "image_to_text_R@1"),
}


def task_of(result: dict) -> str:
    return next(task for metric, (task, _) in TASKS.items() if metric in result)


def main_metric(result: dict) -> str:
    """The name of a set's one number (``headline``'s)."""
    return next(main for metric, (_, main) in TASKS.items() if metric in result)


def headline(result: dict[str, float]) -> float:
    """The one number of a set's result: zero-shot top-1 (mAP for a multi-label set), image-to-text R@1 for
    retrieval, CIDEr (x 100) for captioning, the accuracy (both ways) for image-caption selection, the linear
    probe's top-1, the dense probe's mean IoU."""
    for metric in ("top1", "mAP", "lp_top1", "dense_miou", "cider", "acc"):
        if metric in result:
            return result[metric]
    return result["image_to_text_R@1"]


def results_path(path: Path) -> Path | None:
    """The results file of a checkpoint (``<ckpt>.results.json`` beside it), of a results file itself
    (``.results.json`` or ``.results.csv``) or of a run directory (its ``checkpoints/last.results.json``);
    None where there is none."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / "last.pt"
    name = path.name
    for suffix in (".results.json", ".results.csv"):
        if name.endswith(suffix):
            stem = path.with_name(name.removesuffix(suffix))
            break
    else:
        stem = path.with_suffix("")
    found = stem.with_name(stem.name + ".results.json")
    return found if found.is_file() else None


def read_results(path: Path) -> dict[str, dict]:
    """``{set: {metric: value}}`` from a ``.results.json`` file."""
    results: dict[str, dict] = {}
    for row in json.loads(Path(path).read_text())["rows"]:
        results.setdefault(row["set"], {})[row["metric"]] = row["value"]
    return results


def side_by_side(tables: dict[str, dict[str, dict]]) -> tuple[list[str], list[list]]:
    """Several checkpoints' results (``{label: {set: result}}``) as one table: a row per set (its task and main
    metric) with a column per checkpoint, then the average of the main metrics over the sets every checkpoint
    has (blank where a checkpoint lacks a set)."""
    labels = list(tables)
    sets: dict[str, dict] = {}
    for results in tables.values():
        for name, result in results.items():
            sets.setdefault(name, result)
    header = ["set", "task", "main metric", *labels]
    body = [[name, task_of(result), main_metric(result),
             *[tables[label][name].get(main_metric(result)) if name in tables[label] else None for label in labels]]
            for name, result in sets.items()]
    shared = [name for name in sets if all(name in tables[label] for label in labels)]
    if shared:
        body.append([f"average ({len(shared)} sets{'' if len(shared) == len(sets) else ' in every column'})", "", "",
                     *[sum(headline(tables[label][name]) for name in shared) / len(shared) for label in labels]])
    return header, body


def side_by_side_markdown(header: list[str], body: list[list]) -> str:
    cell = lambda value: "" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in body]
    return "\n".join(lines)


def write_side_by_side(tables: dict[str, dict[str, dict]], out_dir: Path) -> str:
    """``out_dir``/results.md and results.csv: ``side_by_side``'s table; returns it in Markdown."""
    header, body = side_by_side(tables)
    text = side_by_side_markdown(header, body)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows([["" if value is None else value for value in row] for row in body])
    (out_dir / "results.md").write_text(f"# Results side by side\n\n{text}\n")
    return text
