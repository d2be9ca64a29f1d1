"""What the files kept across runs under ``<data.cache_dir>`` (``$MEGABATCH_CACHE``) are named by: the library
versions a kept result depends on, and a file per key, ``<folder>/<model name>-<digest of the key>.<ext>``
(``compile_cache.py``'s compiled towers, ``memory_plan.ProbeCache``'s measured peaks)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from omegaconf import DictConfig


def library_versions() -> dict:
    """The torch, Triton and CUDA versions (Triton's None where it is not installed)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def keyed_file(cfg: DictConfig, folder: str, key: dict, ext: str) -> Path:
    """``<data.cache_dir>/<folder>/<model name>-<sha256 of the key, 20 hex digits>.<ext>``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    name = str(cfg.model.get("name") or "model").replace("/", "_")
    return Path(cfg.data.cache_dir).expanduser() / folder / f"{name}-{digest}.{ext}"
