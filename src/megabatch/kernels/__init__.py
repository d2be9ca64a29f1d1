"""Tile computations of the contrastive loss: fused Triton kernels (``triton_tiles``) beside the
plain-torch reference of the same math (``torch_tiles``). Kernels know nothing of losses or process
groups."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from types import ModuleType

import torch

IMPLS = ("auto", "triton", "torch")

_VALUES_IN: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("feature_values", default=None)


@contextlib.contextmanager
def features_valued_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Within it, the fp32 features a loss is called on hold values of ``dtype`` (bf16 or fp16;
    ``None``: anything): GradCache's phase 2 runs its loss on fp32 copies of its bf16 feature buffers.
    The Triton kernels then take their dot products on copies in ``dtype`` (``triton_tiles.
    _dot_operands``: the same exact products, at twice TF32's rate); the loss's gradients and GEMMs
    stay fp32. Read when the loss is called (``feature_values``), so its backward keeps it."""
    token = _VALUES_IN.set(dtype if dtype in (torch.bfloat16, torch.float16) else None)
    try:
        yield
    finally:
        _VALUES_IN.reset(token)


def feature_values() -> torch.dtype | None:
    """The dtype ``features_valued_in`` promised here, or ``None``."""
    return _VALUES_IN.get()


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
