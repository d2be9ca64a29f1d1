"""Mixed precision of a step: autocast dtype, GradCache feature-buffer dtype, loss scaling."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bf16 on CUDA, fp32 on CPU (the config check has ruled out anything else)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


@dataclass(frozen=True)
class Precision:
    """How one step computes: the encoders under ``autocast()`` (``torch.autocast`` to ``name`` on ``device``; fp32:
    a context that does nothing), the GradCache feature buffers in ``feature_dtype``, the loss to back-propagate
    scaled by ``scaler.scale`` (enabled for fp16 only; otherwise it hands the loss back unchanged). The loss itself
    always runs on fp32 features."""

    name: str
    device: torch.device
    feature_dtype: torch.dtype
    scaler: torch.amp.GradScaler
    autocast: Callable[[], contextlib.AbstractContextManager]

    @classmethod
    def create(cls, name: str, device: torch.device, feature_dtype: str = "auto") -> Precision:
        name = resolve_precision(name, device)
        if feature_dtype == "auto":  # towers computing in bf16 give features of bf16 precision already
            feature_dtype = "bf16" if name == "bf16" else "fp32"
        scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
        autocast = contextlib.nullcontext if name == "fp32" else \
            functools.partial(torch.autocast, device_type=device.type, dtype=DTYPES[name])
        return cls(name, device, DTYPES[feature_dtype], scaler, autocast)

    def __str__(self) -> str:
        return self.name
