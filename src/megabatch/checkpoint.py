"""Checkpoints that load with ``torch.load(..., weights_only=True)``: tensors, numbers, strings.

Layout: ``<run_dir>/checkpoints/last.pt`` plus ``step_<N>.pt`` every ``trainer.ckpt_every`` steps.
Written by rank 0 to a temporary file and renamed, so a crash mid-write never corrupts ``last.pt``.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
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
    """Write ``payload`` to ``path`` atomically and durably: a temporary file in the same folder,
    flushed and fsync'ed, then renamed over ``path``. On failure the temporary file is removed and
    a full disk is named as such."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if _disk_full(error):
            free = shutil.disk_usage(path.parent).free / 1e9
            raise OSError(errno.ENOSPC, f"no space left on the disk of {path.parent} ({free:.2f} GB free) "
                          f"while writing checkpoint {path.name}; free space, lower trainer.keep_ckpts, or "
                          "give a run_dir on a larger disk") from error
        raise


def _disk_full(error: BaseException) -> bool:
    """ENOSPC, also when torch's writer wraps it in a RuntimeError."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


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
    """Load a checkpoint on the CPU with ``weights_only=True``; an unreadable one is a
    ``ConfigError`` naming the file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated, empty, garbage: torch raises many kinds
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ConfigError(f"checkpoint {path} cannot be loaded: {reason} (truncated or not a megabatch "
                          "checkpoint?)") from None
    missing = {"model", "step"} - set(state) if isinstance(state, dict) else {"model", "step"}
    if missing:
        raise ConfigError(f"checkpoint {path} is not a megabatch checkpoint: no {sorted(missing)}")
    return state


def run_checkpoints(ckpt_dir: Path) -> list[Path]:
    """A run's checkpoints, newest first: ``last.pt`` (written with every numbered one and at the
    end), then ``step_<N>.pt`` by decreasing N."""
    if not ckpt_dir.is_dir():
        return []
    numbered = sorted((p for p in ckpt_dir.iterdir() if _STEP_FILE.match(p.name)), reverse=True)
    last = ckpt_dir / "last.pt"
    return ([last] if last.is_file() else []) + numbered


def check_stored_targets(node: Any, where: str = "config") -> None:
    """Refuse a stored config (a checkpoint's) that would build anything but this project's own
    classes and torch's optimizers: Hydra's ``instantiate`` calls whatever ``_target_`` names, so a
    crafted checkpoint could otherwise run code (``weights_only=True`` guards the tensors only)."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, DictConfig):
        target = node.get("_target_")
        if target is not None and not _allowed_target(str(target)):
            raise ConfigError(f"{where}._target_={target!r}: a checkpoint's stored config may build only "
                              "megabatch's own models, losses and schedules (and torch.optim optimizers); "
                              "refusing to load it. Rebuild the model from your own config instead")
        for key, value in node.items_ex(resolve=False):
            check_stored_targets(value, f"{where}.{key}")
    elif isinstance(node, ListConfig):
        for index, value in enumerate(node):
            check_stored_targets(value, f"{where}[{index}]")


def _allowed_target(target: str) -> bool:
    """Defined in megabatch itself (``megabatch.data.offload.os.system`` is ``os.system``: refused),
    or an optimizer class of ``torch.optim``. Nothing outside megabatch is imported to decide."""
    if target.startswith("megabatch."):
        from hydra.utils import get_object

        try:
            found = get_object(target)
        except Exception:  # noqa: BLE001 - unresolvable: not ours
            return False
        return callable(found) and str(getattr(found, "__module__", "")).startswith("megabatch.")
    module, _, name = target.rpartition(".")
    return module == "torch.optim" and isinstance(getattr(torch.optim, name, None), type) \
        and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)


def build_stored(node, where: str):
    """``instantiate`` a node of a checkpoint's stored config, once its targets are checked."""
    from hydra.utils import instantiate

    check_stored_targets(node, where)
    return instantiate(node, _convert_="all")


def load_resume(resume: str | None, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """What to resume from: ``resume=latest`` -> the newest checkpoint of ``run_dir`` that loads
    (each one skipped is warned about; none at all: start fresh); ``resume=<path>`` -> that file;
    ``null`` -> nothing. Returns ``(path, state)``."""
    if resume in (None, "", "none", "null"):
        return None
    if resume != "latest":
        return Path(str(resume)).expanduser(), load_checkpoint(resume)
    candidates = run_checkpoints(run_dir / "checkpoints")
    if not candidates:
        log.info("resume=latest: no checkpoint in %s yet, starting fresh", run_dir)
        return None
    reasons = []
    for path in candidates:
        try:
            return path, load_checkpoint(path)
        except ConfigError as error:
            log.warning("resume=latest: skipping %s", error)
            reasons.append(str(error))
    raise ConfigError(f"resume=latest: none of the {len(candidates)} checkpoints in {run_dir / 'checkpoints'} "
                      f"loads ({'; '.join(reasons)}); remove them to start over, or resume=<path> a good one")
