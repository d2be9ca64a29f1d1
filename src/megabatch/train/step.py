"""One training step's gradient computation (no optimizer), shared by the loop and the tests."""

from __future__ import annotations

import torch

from .precision import autocast


def forward_backward(model, loss_fn, images, texts, precision: str, device, scaler=None) -> torch.Tensor:
    """Encode ``images [b_rank, 3, s, s]`` and ``texts [b_rank, ctx]``, compute the global loss and
    back-propagate it (through ``scaler`` for fp16). Returns the loss, detached.

    The loss itself runs in fp32: features are cast up so the b x b softmax never runs in half
    precision.
    """
    with autocast(precision, device):
        image_features, text_features, scale = model(images, texts)
    loss = loss_fn(image_features.float(), text_features.float(), scale.float())
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return loss.detach()
