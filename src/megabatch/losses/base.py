"""The interface every loss backend implements."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..distributed.gather import check_equal_batch
from ..kernels import IMPLS, narrow_values, tile_module, torch_tiles


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

    ``group``: the process group to span (``None``: the default group, or one process). That every
    rank holds as many rows is checked the first time each row count is met (the trainer's batch
    plan gives every rank the same shapes in the same order).

    A loss with ``uses_bias`` (SigLIP's sigmoid loss) is called with a fourth argument, the model's
    learnable ``bias`` []; the mean over ranks of its gradient is ``dL/d(bias)``, like the scale's.

    ``negatives`` (keyword; ``[n_local, c]``, L2-normalised, the same count on every rank): hard-negative
    captions' features, extra columns of the image->text direction only (NegCLIP): every image's softmax
    runs over the global batch's texts and all ranks' negatives, the text->image direction and the
    positives as without them. Their gradient follows the contract (W x on each rank). A loss with
    ``takes_negatives = False`` refuses them.

    ``values_in`` (keyword): the fp32 features hold values of this dtype (GradCache's phase 2 calls
    the loss on fp32 copies of its bf16 feature buffers); a tiled loss's Triton kernels then take
    their dot products in it, exactly. The gradients and the loss stay fp32.
    """

    uses_bias = False
    takes_negatives = True

    def __init__(self, group=None, caption_weight: float = 0.0, contrastive_weight: float = 1.0,
                 caption_warmup: float = 0.0):
        super().__init__()
        self.group = group
        # loss.caption_weight / loss.contrastive_weight: the step's weights of the caption loss (a CoCa's) and
        # of this loss, and loss.caption_warmup (the share of the steps over which the caption weight rises), kept in
        # the loss's config; the trainer applies them (train/step/objectives), not this module
        self.caption_weight, self.contrastive_weight = float(caption_weight), float(contrastive_weight)
        self.caption_warmup = float(caption_warmup)
        self._checked_rows: set[int] = set()  # the per-rank row counts already checked equal on every rank

    def forward(
        self, image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor,
        bias: torch.Tensor | None = None, *, values_in: torch.dtype | None = None,
        negatives: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if image_features.shape != text_features.shape or image_features.dim() != 2:
            raise ValueError(
                "image_features and text_features must both be [b_local, c]; got "
                f"{tuple(image_features.shape)} and {tuple(text_features.shape)}"
            )
        if self.uses_bias != (bias is not None):
            raise ValueError(f"{type(self).__name__} {'needs' if self.uses_bias else 'takes no'} logit bias; the "
                             "model has one when model.init_logit_bias is set (loss=siglip sets it)")
        self.check_rows(image_features)
        options = self.compute_options(values_in)
        if negatives is not None:
            if not self.takes_negatives:
                raise ValueError(f"{type(self).__name__} takes no hard negatives (data.train.negatives_key): use a "
                                 "softmax loss (loss=infcl, local, disco or vanilla)")
            if negatives.dim() != 2 or negatives.shape[1] != image_features.shape[1]:
                raise ValueError(f"negatives must be [n_local, {image_features.shape[1]}]; "
                                 f"got {tuple(negatives.shape)}")
            self.check_rows(negatives)
            options["negatives"] = negatives
        if self.uses_bias:
            return self.compute(image_features, text_features, scale, bias, **options)
        return self.compute(image_features, text_features, scale, **options)

    def check_rows(self, features: torch.Tensor) -> None:
        """That every rank holds as many rows of ``features``: once per row count (an all-gather and a host
        sync), not per call."""
        if features.shape[0] not in self._checked_rows:
            check_equal_batch(features, self.group)
            self._checked_rows.add(features.shape[0])

    def compute_options(self, values_in: torch.dtype | None) -> dict:
        """``compute``'s keyword arguments: none for the losses on a whole logits matrix (torch GEMMs)."""
        return {}

    def compute(
        self, image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError


class TiledLoss(ContrastiveLoss):
    """A loss whose tile work runs in ``kernels`` (``infcl``, ``siglip``).

    ``impl``: ``auto`` (Triton kernels on CUDA, plain torch elsewhere), ``triton`` or ``torch``.
    ``tile``: rows/columns per tile of the torch implementation (memory tile^2; the Triton kernels
    size their own tiles). ``fp32_precision``: ``tf32`` or ``ieee`` dots for fp32 features.
    """

    def __init__(self, tile: int = 8192, impl: str = "auto", fp32_precision: str = "tf32", group=None,
                 **weights):
        super().__init__(group, **weights)
        if tile <= 0:
            raise ValueError(f"loss.tile={tile} must be positive")
        if fp32_precision not in ("tf32", "ieee"):
            raise ValueError(f"loss.fp32_precision={fp32_precision!r}; use tf32 or ieee")
        if impl not in IMPLS:
            raise ValueError(f"loss.impl={impl!r}; use one of {', '.join(IMPLS)}")
        self.tile, self.impl, self.fp32_precision = tile, impl, fp32_precision

    def compute_options(self, values_in: torch.dtype | None) -> dict:
        return {"values_in": narrow_values(values_in)}

    def tile_functions(self, device: torch.device, *names: str, values_in: torch.dtype | None = None) -> list:
        """The kernels module's functions ``names`` for tensors on ``device``, with this loss's options;
        ``values_in`` (bf16 or fp16) becomes the Triton kernels' ``dots_dtype``, bound into the functions
        that the forward and the backward both call."""
        kernels = tile_module(self.impl, device)
        options = {"fp32_precision": self.fp32_precision}
        if kernels is torch_tiles:
            options["tile"] = self.tile
        elif narrow_values(values_in) is not None:
            options["dots_dtype"] = narrow_values(values_in)
        return [functools.partial(getattr(kernels, name), **options) for name in names]
