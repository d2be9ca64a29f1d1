"""``train.py`` with every ``.pt`` checkpoint write made ``MEGABATCH_TEST_CHECKPOINT_DELAY_S`` seconds
slower (a large checkpoint on a slow filesystem), for the stop tests run under torchrun. The file
``MEGABATCH_TEST_CHECKPOINT_STARTED`` is created when a write begins."""

import os
import runpy
import sys
import time
from pathlib import Path

import megabatch.checkpoint.files as checkpoint

ROOT = Path(__file__).resolve().parents[2]
_save = checkpoint.save_checkpoint


def slow_save(path, payload):
    Path(os.environ["MEGABATCH_TEST_CHECKPOINT_STARTED"]).touch()
    time.sleep(float(os.environ["MEGABATCH_TEST_CHECKPOINT_DELAY_S"]))
    _save(path, payload)


checkpoint.save_checkpoint = slow_save
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
