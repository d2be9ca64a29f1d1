"""Dense single-process reference of the symmetric CLIP loss (for tests and sanity checks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clip_loss_reference(
    image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``(CE(I T^T * scale) + CE(T I^T * scale)) / 2`` over the full ``[b, c]`` batch."""
    logits = scale * image_features @ text_features.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
