"""Shared fixtures: an isolated data cache; Hydra composition (``compose``); the TRITON interpreter
on machines without a GPU. Helpers that are functions, not fixtures, are in ``helpers.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# inductor's C++ kernels for the CPU (the compile tests' stand-in for the GPU's Triton code) in plain
# scalar C++: they compile about a fifth faster than the vectorised ones and give the same results to
# the tests' tolerances (set before torch reads its inductor config; the processes a test starts inherit it)
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one core per pytest-xdist worker (below): inductor compiles in the process that compiles, rather than
    # starting a pool of compile workers per compiling process, each importing torch again
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (read when a kernel is decorated, so
    # before megabatch.kernels.triton_tiles is imported; spawned ranks inherit it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core: one thread each, and in the processes a test
    # starts (train.py, torchrun, spawned ranks), so that the workers do not fight over the cores
    # (two threads each made the slowest test 4x slower)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import megabatch.config  # noqa: E402,F401  (registers the configs' resolvers and schemas)


def pytest_collection_modifyitems(config, items):
    """The main job's runs (minutes each) first where they are selected (CI: `make test-ci`), so that
    pytest-xdist runs the rest beside them rather than leaving a core idle behind them at the end."""
    items.sort(key=lambda item: item.get_closest_marker("main_job") is None)  # stable: the rest in order


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """One digits cache per test session (built on first use, like a fresh machine)."""
    cache = Path(os.environ.get("MEGABATCH_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["MEGABATCH_CACHE"] = str(cache)
    return cache
