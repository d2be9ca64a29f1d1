"""Mixed precision: autocast context and (for fp16) a gradient scaler."""

from __future__ import annotations

import contextlib

import torch

from ..config import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bf16 on CUDA, fp32 on CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision not in DTYPES:
        raise ConfigError(f"trainer.precision={precision!r}; use auto, bf16, fp16 or fp32")
    return precision


def autocast(precision: str, device: torch.device):
    """Autocast for ``precision`` (a no-op context for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler, enabled only for fp16 (bf16 and fp32 need no loss scaling)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
