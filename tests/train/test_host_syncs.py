"""A GradCache step waits for the GPU once (issue 80): the phases are timed with CUDA events read by the log, not
by synchronising after each phase (three host syncs a step before), and the one read of the step's outcome is the
last step's update (``TrainStep.settle``). On a GPU: every synchronising call during a step after the first is
counted (CUDA's sync debug mode for implicit ones: ``.item()``, a copy to the host; ``torch.cuda.synchronize`` and
``Event.synchronize`` for explicit ones). Found this way: the image normalisation copied its mean and std to the
GPU at every forward (16 host syncs a step of 4 sub-batches, in eager mode); they are made once per device now."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.train.build.parts import RunParts
from megabatch.train.step.step import PhaseTimes

from ..helpers import compose
from .test_gradcache import BASE, BATCH


def test_phase_times_read_on_the_cpu_as_host_seconds():
    times = PhaseTimes(cuda=False, host={"data": 0.25})
    times.lap()
    times.lap("encode", minus=0.25)
    assert times["encode"] == 0.0  # clamped at 0
    times.host["data"] += 0.5  # host seconds read as they are now, the spans' once
    time.sleep(0.01)
    times.lap("loss")
    assert set(times) == {"data", "encode", "loss"} and times["data"] == 0.75 and times["loss"] >= 0.01


# model.decoder's caption term: its head runs at the predicted tokens alone, their count read on the host (phase 1)
DECODER = ["model.decoder.layers=1", "model.decoder.width=32", "model.decoder.heads=2", "loss.caption_weight=1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [[], DECODER], ids=["contrastive", "decoder"])
def test_a_gradcache_step_synchronises_the_host_once(monkeypatch, extra):
    parts = RunParts.build(validate(compose(*BASE, "trainer.device=cuda", "model.image.patch_dropout=0",
                                            f"trainer.sub_batch={BATCH // 4}", "loss=infcl", "data.decode=cpu",
                                            *extra)),
                           init_distributed("cuda"))
    stream = parts.inputs(0)
    parts.step.step(stream, lr=1e-3, number=1)  # the first step: kernels tuned and compiled
    parts.step.step(stream, lr=1e-3, number=2)  # a step with a last step to settle
    explicit = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: explicit.append("torch.cuda.synchronize"))
    original = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: explicit.append("Event.synchronize")
                        or original(self))
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome = parts.step.step(stream, lr=1e-3, number=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    implicit = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    # the loss kernels' backward hands cuBLAS its alpha as a number, read once per block of rows (kernels/, issue 82)
    kernels = [where for where in implicit if "/kernels/" in where]
    assert len(kernels) <= 2, kernels
    step = [where for where in implicit if "/kernels/" not in where] + explicit
    assert len(step) <= 1, step  # settle: the last step's norm and flag, in one copy
    assert set(outcome.times) == {"data", "encode", "loss", "replay", "optimizer"}  # read after: resolved then
    parts.close()
