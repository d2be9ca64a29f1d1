"""Shared fixtures: an isolated data cache; Hydra composition (``compose``); the TRITON interpreter
on machines without a GPU. Helpers that are functions, not fixtures, are in ``helpers.py``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# the benchmarks' shared helpers (scripts/benchmarks/bench.py), which a benchmark imports as ``bench`` from its own
# folder: for the tests that load a benchmark script by its path
sys.path.append(str(Path(__file__).resolve().parents[1] / "scripts" / "benchmarks"))

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

# the longest tests after the main job's (40-130 s each on 2 cores, CI's durations of 2026-11-27): started early,
# none of them is left running on one core at the end while the other waits
LONG_TESTS = (
    "test_a_run_resumed_on_1_then_2_then_3_ranks_ends_as_the_uninterrupted_one",
    "test_a_second_run_loads_the_compiled_towers_and_compiles_nothing",
    "test_offloaded_steps_read_ahead_give_bitwise_the_same_gradients_on_two_ranks",
    "test_a_killed_rank_is_named_and_torchrun_restarts_the_run_to_the_same_weights",
    "test_srun_variables_alone_give_the_torchrun_gradients",
    "test_several_ranks_add_no_host_sync_per_step",
    "test_two_torchrun_launches_of_one_rank_each_train_as_one_job",
    "test_sigterm_stops_two_ranks_at_one_step_and_resume_continues_bitwise",
    "test_compiled_towers_under_ddp_give_the_one_process_gradients",
    "test_locked_text_training_on_digits",
)


def pytest_collection_modifyitems(config, items):
    """The main job's runs (minutes each) first where they are selected (CI: `make test-ci`), then the
    longest tests, so that pytest-xdist runs the rest beside them rather than leaving a core idle
    behind one of them at the end."""
    def order(item) -> int:
        if item.get_closest_marker("main_job") is not None:
            return 0
        return 1 if item.originalname in LONG_TESTS else 2

    items.sort(key=order)  # stable: the rest in order


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """One digits cache per test session (built on first use, like a fresh machine)."""
    cache = Path(os.environ.get("MEGABATCH_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["MEGABATCH_CACHE"] = str(cache)
    return cache
