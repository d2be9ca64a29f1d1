"""Contrastive loss backends, one module each, one interface (see ``base.ContrastiveLoss``)."""

from .base import ContrastiveLoss
from .disco import DiscoLoss
from .infcl import InfClLoss
from .local import LocalLoss
from .reference import clip_loss_reference, siglip_loss_reference
from .siglip import SigLipLoss
from .vanilla import VanillaLoss

__all__ = ["ContrastiveLoss", "DiscoLoss", "InfClLoss", "LocalLoss", "SigLipLoss", "VanillaLoss",
           "clip_loss_reference", "siglip_loss_reference"]
