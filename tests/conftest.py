"""Shared fixtures: an isolated data cache, Hydra composition, spawned gloo process groups."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (read when a kernel is decorated, so
    # before megabatch.kernels.contrastive is imported; spawned ranks inherit it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
sys.path.insert(0, str(ROOT / "src"))

import megabatch.config  # noqa: E402,F401  (registers the configs' resolvers)


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """One digits cache per test session (built on first use, like a fresh machine)."""
    cache = Path(os.environ.get("MEGABATCH_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["MEGABATCH_CACHE"] = str(cache)
    return cache


def compose(*overrides: str):
    """The training config as ``python train.py <overrides>`` would see it (no Hydra run dir)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))
