"""The sigmoid loss (SigLIP, Zhai et al. 2023) over the global batch, tiled and on a ring.

    L = -(1/b) sum_i sum_j log sigmoid(z_ij (s <x_i, y_j> + t)),   z_ij = +1 if i = j else -1

Every logit's term is independent (no log-sum-exp couples a row), so one pass over the tiles gives
the loss and, when gradients are wanted, all of them: the forward accumulates ``d_image``,
``d_text``, ``d_scale`` and ``d_bias`` as it goes, and the backward only scales them by the
incoming gradient (no recompute). Across ranks the layout is Inf-CL's: each rank keeps its image
rows; the text blocks travel around the ring (P2P posted before the local tile work, so the
transfer overlaps compute) and each block's text-gradient accumulator travels behind it, arriving
back at its owner complete. Memory is linear in b: features, fp32 gradient accumulators, one stripe
of tiles. The tile work runs in ``kernels``: ``sigmoid_block`` of ``triton_tiles`` (fused kernels,
CUDA) or of ``torch_tiles`` (the plain-torch reference, the CPU path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.gather import group_size
from ..distributed.ring import RingExchange
from ..kernels.torch_tiles import accumulation_dtype
from .base import TiledLoss


class _SigLipLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, image_features, text_features, scale, bias, group, block_fn):
        world, rows = group_size(group), image_features.shape[0]
        ring = RingExchange(group) if world > 1 else None
        acc = accumulation_dtype(image_features.dtype)
        device = image_features.device
        grads = any(ctx.needs_input_grad[:4])
        d_image = torch.zeros(image_features.shape, dtype=acc, device=device) if grads else None
        loss = torch.zeros((), dtype=acc, device=device)
        d_scale, d_bias = torch.zeros_like(loss), torch.zeros_like(loss)
        texts, pending_acc, d_texts = text_features, None, None
        for step in range(world):
            pending_texts = ring.start(texts) if step < world - 1 else None  # next block, in flight
            if grads:  # this rank's share of the held block's text gradients
                d_texts = torch.zeros(texts.shape, dtype=acc, device=device)
            block_loss, block_scale, block_bias = block_fn(image_features, texts, scale, bias, step == 0,
                                                           d_rows=d_image, d_cols=d_texts)
            loss, d_scale, d_bias = loss + block_loss, d_scale + block_scale, d_bias + block_bias
            if grads and pending_acc is not None:  # earlier ranks' share arrived while we computed
                d_texts += pending_acc.wait()
            if grads and ring is not None:
                pending_acc = ring.start(d_texts)  # onward; after the last step: to the owner
            if pending_texts is not None:
                texts = pending_texts.wait()
        d_text = (pending_acc.wait() if ring is not None else d_texts) if grads else None
        total = loss.clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        ctx.save_for_backward(d_image, d_text, d_scale, d_bias)
        ctx.meta = (rows, image_features.dtype, text_features.dtype, scale.dtype, scale.shape,
                    bias.dtype, bias.shape)
        return total / (rows * world)  # the global mean: fp32 (float64 for float64 inputs)

    @staticmethod
    def backward(ctx, grad_output):
        d_image, d_text, d_scale, d_bias = ctx.saved_tensors
        rows, image_dtype, text_dtype, scale_dtype, scale_shape, bias_dtype, bias_shape = ctx.meta
        # W * dL/d(local): L divides by b = W * rows, so each rank's sums are weighted by 1 / rows
        weight = grad_output.to(d_scale.dtype) / rows
        return (_scaled(d_image, weight, image_dtype), _scaled(d_text, weight, text_dtype),
                (weight * d_scale).to(scale_dtype).reshape(scale_shape),
                (weight * d_bias).to(bias_dtype).reshape(bias_shape), None, None)


def _scaled(accumulator: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, chunk: int = 65536) -> torch.Tensor:
    """``(weight * accumulator).to(dtype)`` a chunk of rows at a time: no second [b, c] fp32 buffer."""
    out = torch.empty(accumulator.shape, dtype=dtype, device=accumulator.device)
    for start in range(0, accumulator.shape[0], chunk):
        out[start : start + chunk] = accumulator[start : start + chunk] * weight
    return out


class SigLipLoss(TiledLoss):
    """SigLIP's sigmoid loss over the global batch, tiled, on a ring of GPUs (options:
    ``base.TiledLoss``). Called as ``loss_fn(image_features, text_features, scale, bias)``; the
    contract of ``base.ContrastiveLoss`` extends to the bias: the mean over ranks of its gradient is
    ``dL/dt``.
    """

    uses_bias = True
    takes_negatives = False  # hard negatives are a softmax's extra columns

    def compute(self, image_features, text_features, scale, bias=None, values_in=None) -> torch.Tensor:
        (block_fn,) = self.tile_functions(image_features.device, "sigmoid_block", values_in=values_in)
        return _SigLipLoss.apply(image_features, text_features, scale, bias, self.group, block_fn)
