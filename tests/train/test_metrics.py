"""The log interval's accounting: with GPU decoding, a step's data wait by stream and cause. The sinks: Trackio
(``logger=trackio``, an optional dependency) gets wandb's fields and run name; without the package, a config error."""

from __future__ import annotations

import collections

import pytest

from megabatch.data import gpu_decode
from megabatch.train.trainer.metrics import Interval


def test_an_interval_reports_the_decoding_waits_of_its_own_steps(monkeypatch):
    monkeypatch.setattr(gpu_decode, "wait_seconds", collections.Counter({"look_ahead_source": 1.0}))
    interval = Interval()  # the waits before it are not its own
    assert interval.decode_waits_since() == {}
    gpu_decode.wait_seconds["look_ahead_source"] += 0.6
    gpu_decode.wait_seconds["look_ahead_decode"] += 0.2
    interval.steps = 2
    assert interval.decode_waits_since() == pytest.approx({"look_ahead_source": 0.3, "look_ahead_decode": 0.1})


def fake_trackio(monkeypatch) -> list:
    """A stand-in ``trackio`` module (its ``init`` returns a run with ``log`` and ``finish``) recording its calls."""
    import importlib.machinery
    import sys
    import types

    calls = []

    class Run:
        def log(self, metrics, step=None):
            calls.append(("log", dict(metrics), step))

        def finish(self):
            calls.append(("finish",))

    module = types.ModuleType("trackio")
    module.__spec__ = importlib.machinery.ModuleSpec("trackio", None)
    module.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    monkeypatch.setitem(sys.modules, "trackio", module)
    return calls


def test_trackio_gets_wandbs_fields_and_run_name(tmp_path, monkeypatch):
    from megabatch.config.schema import validate
    from megabatch.train.trainer.metrics import MetricsLogger

    from ..helpers import compose

    calls = fake_trackio(monkeypatch)
    cfg = validate(compose("logger=[jsonl,trackio]"))
    for name in ("my-run", "alone"):
        (tmp_path / name).mkdir()
    logger = MetricsLogger(tmp_path / "my-run", cfg.logger, {"batch": 128}, sweep=("lr-sweep", "3"))
    logger.log({"loss": 2.5, "lr": 1e-3}, step=7)
    logger.close()
    init = calls[0][1]
    assert (init["project"], init["name"], init["group"], init["config"], init["resume"]) == \
        ("megabatch", "lr-sweep/3", "lr-sweep", {"batch": 128}, "allow")
    assert calls[1:] == [("log", {"loss": 2.5, "lr": 1e-3}, 7), ("finish",)]
    alone = MetricsLogger(tmp_path / "alone", cfg.logger, {})
    assert calls[-1][1]["name"] == "alone" and calls[-1][1]["group"] is None  # a single run: its directory's name
    alone.close()


def test_trackio_without_the_package_is_a_config_error(monkeypatch):
    import sys

    from megabatch.config import ConfigError
    from megabatch.config.schema import validate

    from ..helpers import compose

    monkeypatch.setitem(sys.modules, "trackio", None)  # not importable, whether installed here or not
    with pytest.raises(ConfigError, match=r"logger=trackio needs the trackio package .*pip install trackio"):
        validate(compose("logger=trackio"))
