"""Contrastive loss backends, one module each, one interface (see ``base.ContrastiveLoss``)."""

from .base import ContrastiveLoss
from .reference import clip_loss_reference
from .vanilla import VanillaLoss

__all__ = ["ContrastiveLoss", "VanillaLoss", "clip_loss_reference"]
