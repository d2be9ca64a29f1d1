"""Settings compared over seeds: the difference of a metric between two settings run with the same seeds, paired
by seed (each seed's data order and initial weights are both settings'), its mean and a 95% interval (Student's t
over the seeds' differences). Whether a setting is "as good as" another on a small set is a question of this
interval, not of the two means: on the digits' 360 held-out images one image is 0.28 points."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import NamedTuple

# the metrics scripts/benchmarks/learning.py measures per run (where asked), by the name the results page gives them
METRICS = {"zero_shot_top1": "zero-shot", "linear_probe_top1": "linear probe", "dense_miou": "dense mean IoU",
           "caption_accuracy": "captions naming the digit"}
# Student's t at 97.5% for 1 to 30 degrees of freedom; beyond, the normal's 1.96
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


class PairedDifference(NamedTuple):
    mean: float        # the mean over the seeds of (other - baseline)
    half_width: float  # the 95% interval is mean +- half_width (nan with one seed)
    seeds: int         # the seeds both settings have

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def describe(self, unit: str = "") -> str:
        """``-0.52 +- 0.60 (8 seeds)``."""
        width = "" if math.isnan(self.half_width) else f" +- {self.half_width:.2f}{unit}"
        return f"{self.mean:+.2f}{unit}{width} ({self.seeds} seed{'s' if self.seeds != 1 else ''})"


def paired_difference(baseline: Mapping[int, float], other: Mapping[int, float]) -> PairedDifference | None:
    """``other - baseline`` over the seeds both have (``{seed: value}``; a missing or None value leaves the seed
    out); ``None`` when they share no seed."""
    seeds = sorted(seed for seed in baseline.keys() & other.keys()
                   if baseline[seed] is not None and other[seed] is not None)
    if not seeds:
        return None
    differences = [other[seed] - baseline[seed] for seed in seeds]
    mean = statistics.mean(differences)
    if len(differences) < 2:
        return PairedDifference(mean, math.nan, 1)
    df = len(differences) - 1
    t = T_975[df - 1] if df <= len(T_975) else 1.96
    return PairedDifference(mean, t * statistics.stdev(differences) / math.sqrt(len(differences)), len(differences))


def by_seed(rows: list[dict], setting: str, key: str) -> dict[int, float]:
    """``{seed: row[key]}`` of ``setting``'s rows (``scripts/benchmarks/learning.py``'s results)."""
    return {int(row["seed"]): row.get(key) for row in rows if row["setting"] == setting}
