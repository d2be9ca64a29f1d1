"""Tile computations of the contrastive loss: fused Triton kernels (``triton_tiles``) beside the
plain-torch reference of the same math (``torch_tiles``). Kernels know nothing of losses or process
groups."""

from __future__ import annotations

from types import ModuleType

import torch

IMPLS = ("auto", "triton", "torch")


def tile_module(impl: str, device: torch.device) -> ModuleType:
    """The module whose ``block_stats``/``block_grads`` serve tensors on ``device``.

    ``auto``: Triton on CUDA, torch elsewhere. ``triton`` on a CPU needs ``TRITON_INTERPRET=1``
    (the kernels' own input check says so). ``impl`` is one of ``IMPLS`` (checked by the loss).
    """
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl == "torch":
        from . import torch_tiles

        return torch_tiles
    from . import triton_tiles

    return triton_tiles
