"""OpenCLIP's local loss (``ClipLoss(local_loss=True, gather_with_grad=True)``): local rows
against all columns, features gathered with autograd. Memory b^2 / W per rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.gather import all_gather_with_grad, global_mean_value, group_rank
from .base import ContrastiveLoss
from .reference import upcast


class LocalLoss(ContrastiveLoss):
    """Rank r computes ``loss_r`` over its own rows (image->text and text->image) with the positives
    at columns ``r * b_local + i``. The gather's backward sums every rank's column gradients, so
    the local features receive ``d(sum_r loss_r) = W x dL``; the value returned is the mean."""

    def compute(self, image_features, text_features, scale, negatives=None) -> torch.Tensor:
        all_images = all_gather_with_grad(image_features, self.group)
        all_texts = all_gather_with_grad(text_features, self.group)
        rows = image_features.shape[0]
        labels = torch.arange(rows, device=image_features.device) + group_rank(self.group) * rows
        columns = all_texts if negatives is None else \
            torch.cat([all_texts, all_gather_with_grad(negatives, self.group)])
        image_to_text = upcast(image_features @ columns.T) * scale  # [b_local, b (+ every rank's negatives)]
        text_to_image = upcast(text_features @ all_images.T) * scale  # [b_local, b]
        local = (F.cross_entropy(image_to_text, labels) + F.cross_entropy(text_to_image, labels)) / 2
        return global_mean_value(local, self.group)
