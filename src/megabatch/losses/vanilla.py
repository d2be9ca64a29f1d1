"""CLIP's original loss: all-gather the features with gradient, full b x b logits on every rank."""

from __future__ import annotations

import torch

from ..distributed.gather import all_gather_with_grad
from .base import ContrastiveLoss
from .reference import clip_loss_reference


class VanillaLoss(ContrastiveLoss):
    """Memory b^2 per rank. Every rank computes the same L from the gathered features; the gather's
    backward sums the W identical copies of dL/d(local) (hence W x, per the contract), and every
    rank holds the full dL/d(scale)."""

    def compute(self, image_features, text_features, scale, negatives=None) -> torch.Tensor:
        all_images = all_gather_with_grad(image_features, self.group)
        all_texts = all_gather_with_grad(text_features, self.group)
        all_negatives = None if negatives is None else all_gather_with_grad(negatives, self.group)
        return clip_loss_reference(all_images, all_texts, scale, all_negatives)
