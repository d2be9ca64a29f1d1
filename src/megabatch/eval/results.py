"""One results table per checkpoint: every evaluated set's metrics as rows (set, task, metric, value),
written beside the checkpoint as ``<ckpt>.results.csv`` and ``.json``, and printed with each set's main
metric (zero-shot top-1 or a multi-label set's mAP, retrieval image-to-text R@1, captioning CIDEr,
image-caption selection's accuracy, the linear probe's top-1) and their average, the form in which model cards
and OpenCLIP's results CSV compare models."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ..report.results import TASKS, headline, main_metric, task_of  # noqa: F401 (the tables' vocabulary)

NOT_METRICS = ("samples", "step", "ckpt", "weights", "seconds")  # a result's bookkeeping, not a measured number


def results_rows(results: dict[str, dict]) -> list[dict]:
    """``{set name: result}`` as rows ``{set, task, metric, value}``, each set's metrics in its order."""
    return [{"set": name, "task": task_of(result), "metric": metric, "value": float(value)}
            for name, result in results.items() for metric, value in result.items()
            if metric not in NOT_METRICS and isinstance(value, (int, float))]


def average_of_main_metrics(results: dict[str, dict]) -> float:
    return sum(headline(result) for result in results.values()) / len(results)


def write_results(stem: Path, results: dict[str, dict], step: int | None = None) -> tuple[Path, Path]:
    """``<stem>.results.csv`` and ``<stem>.results.json`` (the rows, and the average of the main
    metrics in the JSON); returns both paths. With the checkpoint's ``step``, the sets an earlier evaluation of
    the same checkpoint (the same step) wrote there stay in the table beside these (``scripts/evaluate.py`` one
    set today, another tomorrow); a file from another step is replaced. Returns both paths."""
    csv_path, json_path = stem.with_name(stem.name + ".results.csv"), stem.with_name(stem.name + ".results.json")
    if step is not None and json_path.is_file():
        try:
            earlier = json.loads(json_path.read_text())
        except (OSError, ValueError):
            earlier = {}
        if earlier.get("step") == step:
            from ..report.results import read_results

            results = {**{name: result for name, result in read_results(json_path).items() if name not in results},
                       **results}
    rows = results_rows(results)
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["set", "task", "metric", "value"])
        writer.writeheader()
        writer.writerows(rows)
    json_path.write_text(json.dumps({"rows": rows, "average_main_metric": average_of_main_metrics(results),
                                     **({"step": step} if step is not None else {})}, indent=1))
    return csv_path, json_path


def results_table(results: dict[str, dict]) -> str:
    """Each set's main metric, one line a set, and their average (a Markdown table)."""
    lines = ["| set | task | main metric | value |", "|---|---|---|---|"]
    lines += [f"| {name} | {task_of(result)} | {main_metric(result)} | {headline(result):.2f} |"
              for name, result in results.items()]
    lines.append(f"| average | | | {average_of_main_metrics(results):.2f} |")
    return "\n".join(lines)

