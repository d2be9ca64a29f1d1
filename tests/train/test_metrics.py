"""The log interval's accounting: with GPU decoding, a step's data wait by stream and cause."""

from __future__ import annotations

import collections

import pytest

from megabatch.data import gpu_decode
from megabatch.train.metrics import Interval


def test_an_interval_reports_the_decoding_waits_of_its_own_steps(monkeypatch):
    monkeypatch.setattr(gpu_decode, "wait_seconds", collections.Counter({"look_ahead_source": 1.0}))
    interval = Interval()  # the waits before it are not its own
    assert interval.decode_waits_since() == {}
    gpu_decode.wait_seconds["look_ahead_source"] += 0.6
    gpu_decode.wait_seconds["look_ahead_decode"] += 0.2
    interval.steps = 2
    assert interval.decode_waits_since() == pytest.approx({"look_ahead_source": 0.3, "look_ahead_decode": 0.1})
