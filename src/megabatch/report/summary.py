"""A sweep side by side: ``summary.csv``, ``summary.md`` (one row per run) and ``summary.png`` (the
training loss of every run against samples seen; each evaluation metric against the swept
parameter, the best run marked).

``find_runs`` takes sweep directories (``runs/<sweep>``, whose numbered jobs are runs) or run
directories; ``write_summary`` writes the three files and returns the Markdown table.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import threading
from pathlib import Path

from .runs import RunRow, is_run_dir, read_run

SUMMARY_FILES = ("summary.csv", "summary.md", "summary.png")


def find_runs(paths: list[Path]) -> list[Path]:
    """The run directories in ``paths``: each one itself if it is a run, else its sub-directories that
    are runs (a sweep's jobs, numbered ones in their number's order)."""
    found = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such directory (give a sweep's directory runs/<name> or runs)")
        if is_run_dir(path) and not any(is_run_dir(p) for p in path.iterdir() if p.is_dir()):
            found.append(path)
            continue
        jobs = [p for p in path.iterdir() if p.is_dir() and is_run_dir(p)]
        found += sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    return found


def swept_keys(rows: list[RunRow]) -> list[str]:
    """The override keys whose values differ between the runs, in the order they were given."""
    keys: list[str] = []
    values: dict[str, set] = {}
    for row in rows:
        for override in row.overrides:
            key, _, value = override.partition("=")
            if key not in values:
                keys.append(key)
            values.setdefault(key, set()).add(value)
    return [k for k in keys if len(values[k]) > 1 or any(k not in _as_dict(r) for r in rows)]


def best_run(rows: list[RunRow], metric: str | None) -> RunRow | None:
    """The run with the highest final ``metric`` (an evaluation), else the lowest last loss."""
    if metric is not None:
        scored = [r for r in rows if metric in r.evals]
        return max(scored, key=lambda r: r.evals[metric]) if scored else None
    scored = [r for r in rows if r.last_loss is not None]
    return min(scored, key=lambda r: r.last_loss) if scored else None


def headline_metric(rows: list[RunRow]) -> str | None:
    """The metric that ranks the runs: the first evaluation set's top-1 (or image-to-text R@1)."""
    keys = [k for r in rows for k in r.evals]
    for suffix in ("/top1", "/image_to_text_R@1"):
        matching = [k for k in keys if k.endswith(suffix)]
        if matching:
            return matching[0]
    return keys[0] if keys else None


def table(rows: list[RunRow]) -> tuple[list[str], list[list]]:
    """The summary's header and one row of values per run (numbers as numbers, ``None`` where a run has
    no such value): the CSV holds them as they are, ``markdown`` formats them."""
    swept = swept_keys(rows)
    metrics = list(dict.fromkeys(k for r in rows for k in r.evals))
    best = best_run(rows, headline_metric(rows)) if len(rows) > 1 else None
    header = ["run", "best", *swept, "status", "steps", "samples seen", "last loss", "best loss"]
    for metric in metrics:
        header += [metric.removeprefix("eval/"), f"best {metric.removeprefix('eval/')}"]
    header += ["samples/s", "MFU %", "peak GPU GB", "peak host GB", "first step s", "wall s", "checkpoint", "overrides",
               "error"]
    body = []
    for row in rows:
        overrides = _as_dict(row)
        line = [row.name, "best" if row is best else "", *(overrides.get(k, "") for k in swept), row.status,
                row.steps, row.samples_seen, _round(row.last_loss, 4), _round(row.best_loss, 4)]
        for metric in metrics:
            line += [_round(row.evals.get(metric), 2), _round(row.best_evals.get(metric), 2)]
        line += [_round(row.samples_per_s, 1), _round(None if row.mfu is None else 100 * row.mfu, 2),
                 _round(row.peak_gpu_gb, 2), _round(row.peak_host_gb, 2), _round(row.first_step_s, 1),
                 _round(row.wall_s, 1),
                 row.checkpoint, " ".join(row.overrides), row.error.splitlines()[0][:200] if row.error else None]
        body.append(line)
    return header, body


def markdown(header: list[str], body: list[list], rows: list[RunRow]) -> str:
    """The table for reading: numbers formatted, wall time as 1h02m, the ``overrides`` column left out
    (the CSV keeps it): the overrides every run shares are one line above it, the swept ones are columns."""
    keep = [i for i, name in enumerate(header) if name != "overrides"]
    names = [("wall" if header[i] == "wall s" else header[i]) for i in keep]
    cells = lambda values: "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"
    shared = [o for o in (rows[0].overrides if rows else []) if all(o in r.overrides for r in rows)]
    lines = [f"shared overrides: `{' '.join(shared)}`", ""] if shared else []
    formatted = [[_cell(header[i], line[i]) for i in keep] for line in body]
    return "\n".join([*lines, cells(names), "|" + "---|" * len(keep), *map(cells, formatted)]) + "\n"


def _cell(name: str, value) -> str:
    if value is None:
        return ""
    if name == "wall s":
        return _duration(value)
    if name in ("samples seen", "samples/s", "steps"):
        return f"{value:,.0f}"
    if name in ("MFU %", "peak GPU GB", "peak host GB"):
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.4f}" if "loss" in name else f"{value:.2f}"
    return str(value)


def _round(value: float | None, digits: int) -> float | None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return round(value, digits)


def write_summary(paths: list[Path], out_dir: Path, title: str | None = None) -> str:
    """Summarise the runs found in ``paths`` into ``out_dir``/summary.{csv,md,png}; return the table
    in Markdown. Runs in progress are shown as they are now."""
    rows = [read_run(p) for p in find_runs(paths)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header, body = table(rows)
    text = markdown(header, body, rows)
    # each file written whole then renamed: a sweep's jobs on several nodes may rewrite them at once
    with _replaced(out_dir / "summary.csv") as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in line] for line in body])
    with _replaced(out_dir / "summary.md") as tmp:
        tmp.write_text(f"# {title or out_dir.name}\n\n{text}")
    with _replaced(out_dir / "summary.png") as tmp:
        plot(rows, tmp, title or out_dir.name)
    tables = run_results(find_runs(paths))
    if tables:  # the runs' last checkpoints' evaluation tables side by side, beside the summary
        from .results import write_side_by_side

        text += f"\n\nEvaluations of the last checkpoints (results.md, results.csv):\n\n" \
                f"{write_side_by_side(tables, out_dir)}\n"
    return text


def run_results(run_dirs: list[Path]) -> dict[str, dict]:
    """``{run name: {set: result}}`` of the runs whose last checkpoint has a results table."""
    from .results import read_results, results_path

    tables = {}
    for run_dir in run_dirs:
        found = results_path(run_dir)
        if found is not None:
            tables[Path(run_dir).name] = read_results(found)
    return tables


@contextlib.contextmanager
def _replaced(path: Path):
    """A temporary file beside ``path`` that replaces it when the block ends without an error."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp{path.suffix}")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def plot(rows: list[RunRow], path: Path, title: str) -> None:
    """Left: the training loss of each run against samples seen. Right: each evaluation metric at the
    end of each run against the swept parameter (log axis for counts such as batch), best marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    swept = swept_keys(rows)
    metrics = plotted_metrics(rows)
    labels = {id(r): ", ".join(f"{k}={_as_dict(r).get(k, '')}" for k in swept) or r.name for r in rows}
    figure, axes = plt.subplots(1, 2, figsize=(13, 5), squeeze=True)
    loss_axis, metric_axis = axes
    for row in rows:
        if row.curve:
            samples, losses = zip(*row.curve, strict=True)
            loss_axis.plot(samples, losses, label=f"{labels[id(row)]} ({row.status})")
    loss_axis.set(xlabel="samples seen", ylabel="training loss", title="training loss")
    if any(row.curve for row in rows):
        loss_axis.legend(fontsize=8)
    loss_axis.grid(alpha=0.3)

    key = swept[0] if len(swept) == 1 else None
    positions = _positions(rows, key)
    best = best_run(rows, headline_metric(rows))
    for metric in metrics:
        points = [(positions[id(r)], r.evals[metric]) for r in rows if metric in r.evals and id(r) in positions]
        if points:
            points.sort()
            metric_axis.plot(*zip(*points, strict=True), marker="o", label=metric.removeprefix("eval/"))
    if best is not None and id(best) in positions and best.evals:
        value = best.evals[headline_metric(rows)]
        metric_axis.scatter([positions[id(best)]], [value], s=250, facecolors="none", edgecolors="red", zorder=5,
                            label=f"best: {labels[id(best)]} ({value:.2f})")
    if key is not None and _numeric(rows, key):
        values = [positions[id(r)] for r in rows if id(r) in positions]
        if values and min(values) > 0 and (key == "batch" or max(values) / min(values) >= 8):
            metric_axis.set_xscale("log", base=2 if key == "batch" else 10)
        texts = {positions[id(r)]: _as_dict(r)[key] for r in rows if id(r) in positions}  # as the user wrote them
        metric_axis.set_xticks(sorted(texts), [texts[v] for v in sorted(texts)])
        metric_axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        metric_axis.set_xlabel(key)
    else:
        metric_axis.set_xticks(range(len(rows)), [labels[id(r)] for r in rows], rotation=30, ha="right", fontsize=8)
        metric_axis.set_xlabel("run")
    metric_axis.set(ylabel="at the end of the run", title="evaluation" if metrics else "evaluation (none logged)")
    if metrics:
        metric_axis.legend(fontsize=8)
    metric_axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plotted_metrics(rows: list[RunRow]) -> list[str]:
    """Each evaluation set's headline numbers (top-1; R@1 both ways for retrieval), else every metric."""
    every = list(dict.fromkeys(k for r in rows for k in r.evals))
    headline = [k for k in every if k.endswith(("/top1", "/image_to_text_R@1", "/text_to_image_R@1"))]
    return headline or every


def _positions(rows: list[RunRow], key: str | None) -> dict[int, float]:
    """Each run's place on the metric plot's x axis: its value of the swept ``key``, else its index."""
    if key is not None and _numeric(rows, key):
        return {id(r): _value(_as_dict(r)[key]) for r in rows if key in _as_dict(r)}
    return {id(r): float(i) for i, r in enumerate(rows)}


def _numeric(rows: list[RunRow], key: str) -> bool:
    try:
        return all(_value(_as_dict(r)[key]) is not None for r in rows)
    except KeyError:
        return False


def _value(text: str) -> float | None:
    from ..config import ConfigError, parse_count

    try:
        return float(text)
    except ValueError:
        try:
            return float(parse_count(text, "value"))  # 32k, 1M
        except ConfigError:
            return None


def _as_dict(row: RunRow) -> dict[str, str]:
    return dict(o.partition("=")[::2] for o in row.overrides)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
