"""The interface every loss backend implements."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.gather import check_equal_batch


class ContrastiveLoss(nn.Module):
    """Symmetric CLIP loss over the global batch.

    Called as ``loss_fn(image_features [b_local, c], text_features [b_local, c], scale [])`` with
    L2-normalised features and ``scale = logit_scale.exp()``. Returns
    ``L = (CE(image->text) + CE(text->image)) / 2`` averaged over the global batch (all ranks'
    samples in rank order, positives on the diagonal); the same value on every rank.

    Gradient contract (what DDP's mean needs): on each of W ranks, the gradient reaching the local
    features is ``W * dL/d(local features)``, and the mean over ranks of the ``scale`` gradient is
    ``dL/d(scale)``. The returned value is L, but its backward carries these W-scaled gradients:
    a reduction other than DDP's mean (a manual sum, FSDP hooks) must account for the factor W.

    ``group``: the process group to span (``None``: the default group, or one process).

    A loss with ``uses_bias`` (SigLIP's sigmoid loss) is called with a fourth argument, the model's
    learnable ``bias`` []; the mean over ranks of its gradient is ``dL/d(bias)``, like the scale's.
    """

    uses_bias = False

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(
        self, image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if image_features.shape != text_features.shape or image_features.dim() != 2:
            raise ValueError(
                "image_features and text_features must both be [b_local, c]; got "
                f"{tuple(image_features.shape)} and {tuple(text_features.shape)}"
            )
        if self.uses_bias != (bias is not None):
            raise ValueError(f"{type(self).__name__} {'needs' if self.uses_bias else 'takes no'} logit bias; the "
                             "model has one when model.init_logit_bias is set (loss=siglip sets it)")
        check_equal_batch(image_features, self.group)
        if self.uses_bias:
            return self.compute(image_features, text_features, scale, bias)
        return self.compute(image_features, text_features, scale)

    def compute(
        self, image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError
