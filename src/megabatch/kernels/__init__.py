"""Tile computations of the contrastive loss: fused Triton kernels (``triton_tiles``) beside the
plain-torch reference of the same math (``torch_tiles``). Kernels know nothing of losses or process
groups."""

from __future__ import annotations

from types import ModuleType

import torch

IMPLS = ("auto", "triton", "torch")


def narrow_values(dtype: torch.dtype | None) -> torch.dtype | None:
    """``dtype`` if fp32 features holding values of it can take their dot products in it (bf16 or
    fp16: the Triton kernels' ``dots_dtype``, the same exact products at twice TF32's rate), else
    ``None`` (fp32 values: nothing to promise)."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


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
