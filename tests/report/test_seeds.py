"""Settings compared over seeds, paired by seed, with a 95% interval (report/seeds.py)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from megabatch.report.seeds import by_seed, paired_difference


def test_the_difference_is_paired_by_seed_with_students_interval():
    baseline = {0: 98.0, 1: 96.0, 2: 99.0, 3: 97.0}
    other = {3: 96.5, 0: 97.0, 2: 99.5, 1: 96.0, 9: 50.0}  # seed 9 has no baseline: left out
    paired = paired_difference(baseline, other)
    differences = [-1.0, 0.0, 0.5, -0.5]
    assert paired.seeds == 4 and paired.mean == pytest.approx(-0.25)
    # t(0.975, 3) = 3.182 times the standard error of the four differences
    assert paired.half_width == pytest.approx(3.182 * statistics.stdev(differences) / 2)
    assert paired.low < 0 < paired.high and paired.describe("%").startswith("-0.25% +- ")


def test_missing_values_one_seed_and_no_common_seed():
    assert paired_difference({0: 1.0}, {1: 2.0}) is None
    one = paired_difference({0: 1.0, 1: None}, {0: 3.0, 1: 4.0})
    assert one.seeds == 1 and one.mean == 2.0 and math.isnan(one.half_width)
    assert one.describe() == "+2.00 (1 seed)"


def test_the_interval_covers_a_true_difference_about_95_in_100_times():
    rng = random.Random(0)
    covered = 0
    for _ in range(2000):
        seeds = {seed: rng.gauss(97, 1.0) for seed in range(6)}
        other = {seed: value - 0.3 + rng.gauss(0, 0.4) for seed, value in seeds.items()}
        paired = paired_difference(seeds, other)
        covered += paired.low <= -0.3 <= paired.high
    assert 0.93 < covered / 2000 < 0.97


def test_rows_by_seed():
    rows = [{"setting": "a", "seed": 0, "top1": 1.0}, {"setting": "b", "seed": 0, "top1": 2.0},
            {"setting": "a", "seed": 1, "top1": None}]
    assert by_seed(rows, "a", "top1") == {0: 1.0, 1: None}
