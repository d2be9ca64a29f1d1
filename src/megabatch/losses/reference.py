"""Dense single-process reference of the symmetric CLIP loss (for tests and sanity checks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits to fp32: a softmax over 1M columns must not run in bf16."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def clip_loss_reference(
    image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor,
    negatives: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(CE(I T^T * scale) + CE(T I^T * scale)) / 2`` over the full ``[b, c]`` batch; with
    ``negatives [n, c]`` (hard negatives) the image->text softmax runs over ``[T; negatives]``.

    The GEMM runs in the features' dtype; the softmax in fp32 (or float64) at least.
    """
    rows = image_features.shape[0]
    columns = text_features if negatives is None else torch.cat([text_features, negatives])
    logits = upcast(image_features @ columns.T) * scale  # [b, b (+ n)]
    labels = torch.arange(rows, device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits[:, :rows].T, labels)) / 2


def siglip_loss_reference(
    image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """``-(1/b) sum_ij log sigmoid(z_ij (scale * I T^T + bias)_ij)``, ``z = 2 I - 1``, dense."""
    logits = upcast(image_features @ text_features.T) * scale + bias
    signs = 2 * torch.eye(logits.shape[0], dtype=logits.dtype, device=logits.device) - 1
    return -F.logsigmoid(signs * logits).sum() / logits.shape[0]
