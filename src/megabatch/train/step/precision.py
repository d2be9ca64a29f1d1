"""Mixed precision of a step: autocast dtype, GradCache feature-buffer dtype, loss scaling."""

from __future__ import annotations

import contextlib
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
    """How one step computes: the encoders under autocast to ``name`` (fp32: no autocast), the
    GradCache feature buffers in ``feature_dtype``, the loss scaled by ``scaler`` (enabled for fp16
    only). The loss itself always runs on fp32 features."""

    name: str
    device: torch.device
    feature_dtype: torch.dtype
    scaler: torch.amp.GradScaler

    @classmethod
    def create(cls, name: str, device: torch.device, feature_dtype: str = "auto") -> Precision:
        name = resolve_precision(name, device)
        if feature_dtype == "auto":  # towers computing in bf16 give features of bf16 precision already
            feature_dtype = "bf16" if name == "bf16" else "fp32"
        scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
        return cls(name, device, DTYPES[feature_dtype], scaler)

    def autocast(self):
        """Autocast for ``name`` on ``device`` (a no-op context for fp32)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.name])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate: scaled for fp16, unchanged otherwise."""
        return self.scaler.scale(loss)

    def __str__(self) -> str:
        return self.name
