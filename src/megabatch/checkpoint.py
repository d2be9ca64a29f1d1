"""Checkpoints that load with ``torch.load(..., weights_only=True)``: tensors, numbers, strings.

Layout: ``<run_dir>/checkpoints/last.pt`` plus ``step_<N>.pt`` every ``trainer.ckpt_every`` steps.
Written by rank 0 to a temporary file and renamed, so a crash mid-write never corrupts ``last.pt``.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU and CUDA) as tensors."""
    state = {
        "python": torch.tensor(random.getstate()[1], dtype=torch.int64),
        "python_pos": torch.tensor(random.getstate()[2] or 0),
        "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "numpy_pos": torch.tensor(np.random.get_state()[2]),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``."""
    random.setstate((3, tuple(int(x) for x in state["python"]), None))
    np_state = np.random.get_state()
    np.random.set_state(
        (np_state[0], state["numpy"].numpy().astype(np.uint32), int(state["numpy_pos"]), 0, 0.0)
    )
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (temp file in the same folder, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def write_run_checkpoint(
    ckpt_dir: Path, payload: dict[str, Any], step: int, numbered: bool, keep: int | None
) -> None:
    """Save ``last.pt`` (and ``step_<N>.pt`` if ``numbered``), pruning old numbered files."""
    save_checkpoint(ckpt_dir / "last.pt", payload)
    if numbered:
        save_checkpoint(ckpt_dir / f"step_{step:08d}.pt", payload)
        if keep:
            numbered_files = sorted(p for p in ckpt_dir.iterdir() if _STEP_FILE.match(p.name))
            for old in numbered_files[:-keep]:
                old.unlink()
    log.info("checkpoint at step %d -> %s", step, ckpt_dir / "last.pt")


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint on the CPU with ``weights_only=True``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    return torch.load(path, map_location="cpu", weights_only=True)


def find_resume_path(resume: str | None, run_dir: Path) -> Path | None:
    """``resume=latest`` -> ``<run_dir>/checkpoints/last.pt`` if it exists (else start fresh);
    ``resume=<path>`` -> that file (which must exist); ``null`` -> none."""
    if resume in (None, "", "none", "null"):
        return None
    if resume == "latest":
        last = run_dir / "checkpoints" / "last.pt"
        if last.exists():
            return last
        log.info("resume=latest: no checkpoint in %s yet, starting fresh", run_dir)
        return None
    path = Path(str(resume)).expanduser()
    if not path.is_file():
        raise ConfigError(f"resume={resume!r}: no such checkpoint file (use resume=latest or a .pt path)")
    return path
