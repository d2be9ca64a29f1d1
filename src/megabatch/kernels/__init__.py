"""Tile computations of the contrastive loss: Triton kernels (``contrastive``) beside the
plain-torch reference of the same math (``tiles``). Kernels know nothing of losses or process
groups."""

from __future__ import annotations

import os
from types import ModuleType

import torch

IMPLS = ("auto", "triton", "torch")


def tile_module(impl: str, device: torch.device) -> ModuleType:
    """The module whose ``block_stats``/``block_grads`` serve tensors on ``device``.

    ``auto``: Triton on CUDA, torch elsewhere. ``triton`` on a CPU needs ``TRITON_INTERPRET=1``.
    """
    if impl not in IMPLS:
        raise ValueError(f"loss.impl={impl!r}; use one of {', '.join(IMPLS)}")
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl == "torch":
        from . import tiles

        return tiles
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            f"loss.impl=triton needs CUDA tensors (these are on {device}); use loss.impl=auto or torch, "
            "or set TRITON_INTERPRET=1 to run the kernels on the CPU (slow; for tests)"
        )
    from . import contrastive

    return contrastive
