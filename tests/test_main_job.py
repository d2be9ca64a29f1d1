"""The main job as README's `make demo` runs it: `python train.py`, no arguments."""

from __future__ import annotations

import re

from .conftest import ROOT
from .test_entrypoints import run_script


def test_main_job_reaches_85_percent_zero_shot(tmp_path):
    result = run_script(str(ROOT / "train.py"), cwd=tmp_path)
    top1 = float(re.search(r"zero-shot top-1 on digits \(held out\): ([\d.]+)%", result.stdout)[1])
    print(f"main job zero-shot top-1: {top1:.2f}%")
    assert top1 >= 85.0
