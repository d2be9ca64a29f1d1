"""The main job as README's `make demo` runs it: `python train.py`, no arguments. About 2
minutes on 2 cores: marked ``main_job``, left out of the default run; `make test-main-job` runs it,
and CI runs it with the suite (`make test-ci`, these first)."""

from __future__ import annotations

import re

import pytest

from .helpers import ROOT, run_script


@pytest.mark.main_job
def test_main_job_reaches_85_percent_zero_shot(tmp_path):
    result = run_script(str(ROOT / "train.py"), cwd=tmp_path)
    top1 = float(re.search(r"zero-shot top-1 on digits \(held out\): ([\d.]+)%", result.stdout)[1])
    print(f"main job zero-shot top-1: {top1:.2f}%")
    assert top1 >= 85.0


@pytest.mark.main_job
@pytest.mark.slow  # 206 s of one CI core: make test-main-job and make test-all (the sigmoid loss's gradients are in CI)
def test_siglip_on_the_main_job_reaches_85_percent_zero_shot(tmp_path):
    """The sigmoid loss in the main job's budget: `python train.py loss=siglip`, nothing else."""
    result = run_script(str(ROOT / "train.py"), "loss=siglip", cwd=tmp_path)
    top1 = float(re.search(r"zero-shot top-1 on digits \(held out\): ([\d.]+)%", result.stdout)[1])
    print(f"siglip main job zero-shot top-1: {top1:.2f}%")
    assert top1 >= 85.0
