"""One results table per checkpoint: every evaluated set's metrics as rows (set, task, metric, value),
written beside the checkpoint as ``<ckpt>.results.csv`` and ``.json``, and printed with each set's main
metric (zero-shot top-1 or a multi-label set's mAP, retrieval image-to-text R@1, captioning CIDEr,
image-caption selection's accuracy, the linear probe's top-1) and their average, the form in which model cards
and OpenCLIP's results CSV compare models."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .zeroshot import headline

NOT_METRICS = ("samples", "step", "ckpt", "weights", "seconds")  # a result's bookkeeping, not a measured number


TASKS = {  # a result's task, told by the metric only it has, and that task's main metric
    "top1": ("zeroshot", "top1"),
    "mAP": ("zeroshot_multilabel", "mAP"),
    "lp_top1": ("linear_probe", "lp_top1"),
    "cider": ("captioning", "cider"),
    "acc": ("image_caption_selection", "acc"),
    "image_to_text_R@1": ("retrieval", "image_to_text_R@1"),
}


def task_of(result: dict) -> str:
    return next(task for metric, (task, _) in TASKS.items() if metric in result)


def main_metric(result: dict) -> str:
    """The name of a set's one number (``headline``'s)."""
    return next(main for metric, (_, main) in TASKS.items() if metric in result)


def results_rows(results: dict[str, dict]) -> list[dict]:
    """``{set name: result}`` as rows ``{set, task, metric, value}``, each set's metrics in its order."""
    return [{"set": name, "task": task_of(result), "metric": metric, "value": float(value)}
            for name, result in results.items() for metric, value in result.items()
            if metric not in NOT_METRICS and isinstance(value, (int, float))]


def average_of_main_metrics(results: dict[str, dict]) -> float:
    return sum(headline(result) for result in results.values()) / len(results)


def write_results(stem: Path, results: dict[str, dict]) -> tuple[Path, Path]:
    """``<stem>.results.csv`` and ``<stem>.results.json`` (the rows, and the average of the main
    metrics in the JSON); returns both paths."""
    rows = results_rows(results)
    csv_path, json_path = stem.with_name(stem.name + ".results.csv"), stem.with_name(stem.name + ".results.json")
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["set", "task", "metric", "value"])
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps({"rows": rows, "average_main_metric": average_of_main_metrics(results)},
                                    indent=1))
    return csv_path, json_path


def results_table(results: dict[str, dict]) -> str:
    """Each set's main metric, one line a set, and their average (a Markdown table)."""
    lines = ["| set | task | main metric | value |", "|---|---|---|---|"]
    lines += [f"| {name} | {task_of(result)} | {main_metric(result)} | {headline(result):.2f} |"
              for name, result in results.items()]
    lines.append(f"| average | | | {average_of_main_metrics(results):.2f} |")
    return "\n".join(lines)


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
