"""DisCo-CLIP: gather without autograd, local rows, and one all-reduce of the gathered feature
gradients in backward (keeping the local slice). Memory b^2 / W per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.gather import gather_no_grad, group_rank, group_size
from .base import ContrastiveLoss
from .reference import upcast


class _DiscoLoss(torch.autograd.Function):
    """Forward: ``loss_r`` from local rows against the gathered columns (both directions; with hard
    negatives, every rank's negatives are extra columns of the image->text direction), and the mean over
    ranks as the value. Backward: local-row gradients directly; the column gradients of all ranks are
    summed by one all-reduce of ``[2b (+ n), c]`` (a sum, not DisCo's "average", which would lose the
    factor W) and the local slices kept."""

    @staticmethod
    def forward(ctx, image_features, text_features, scale, negatives, group):
        world, rank, rows = group_size(group), group_rank(group), image_features.shape[0]
        all_images = gather_no_grad(image_features, group)
        columns = gather_no_grad(text_features, group)  # [b, c]; with negatives [b + n, c]
        if negatives is not None:
            columns = torch.cat([columns, gather_no_grad(negatives, group)])
        labels = torch.arange(rows, device=image_features.device) + rank * rows
        image_to_text = upcast(image_features @ columns.T) * scale  # [b_local, b (+ n)]
        text_to_image = upcast(text_features @ all_images.T) * scale  # [b_local, b]
        lse_i, lse_t = image_to_text.logsumexp(1), text_to_image.logsumexp(1)
        positives = image_to_text.gather(1, labels[:, None]).squeeze(1)  # = text_to_image's
        local = ((lse_i - positives).sum() + (lse_t - positives).sum()) / (2 * rows)
        total = local.clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        # keep the logits (not the softmax): backward re-derives P with one element-wise pass
        # and the scale gradient from the logits themselves, with no GEMM recomputation
        ctx.save_for_backward(image_features, text_features, all_images, columns, scale, labels,
                              image_to_text, text_to_image, lse_i, lse_t)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        ctx.negatives = None if negatives is None else negatives.shape[0]
        return total / world

    @staticmethod
    def backward(ctx, grad_output):
        (image_features, text_features, all_images, columns, scale, labels,
         image_to_text, text_to_image, lse_i, lse_t) = ctx.saved_tensors
        rows, world, rank = image_features.shape[0], ctx.world, ctx.rank
        weight = grad_output / (2 * rows)

        def logit_grads(logits, lse):
            """d loss_r / d logits = weight * (softmax - onehot), and its share of d/d scale."""
            grad = torch.exp(logits - lse[:, None])
            grad[torch.arange(rows), labels] -= 1
            grad *= weight
            return grad, (grad * logits).sum() / scale

        g_image, ds_image = logit_grads(image_to_text, lse_i)
        g_text, ds_text = logit_grads(text_to_image, lse_t)
        dtype = image_features.dtype
        g_image_in, g_text_in = g_image.to(dtype), g_text.to(dtype)  # GEMMs in the input dtype
        # column gradients of every rank's loss w.r.t. the gathered features: images [b], then the
        # columns of the image->text direction (texts [b], negatives [n])
        d_columns = upcast(torch.cat([g_text_in.T @ text_features, g_image_in.T @ image_features]))
        d_columns *= scale  # summed over ranks in fp32 at least
        if world > 1:
            dist.all_reduce(d_columns, group=ctx.group)
        b = world * rows
        d_image = (g_image_in @ columns) * scale + d_columns[rank * rows:(rank + 1) * rows]
        d_text = (g_text_in @ all_images) * scale + d_columns[b + rank * rows:b + (rank + 1) * rows]
        d_negatives = None
        if ctx.negatives is not None:
            n = ctx.negatives
            d_negatives = d_columns[2 * b + rank * n:2 * b + (rank + 1) * n].to(dtype)
        d_scale = ds_image + ds_text
        return d_image.to(dtype), d_text.to(dtype), d_scale.reshape(scale.shape), d_negatives, None


class DiscoLoss(ContrastiveLoss):
    """DisCo-CLIP's distributed loss with a hand-written backward (see ``_DiscoLoss``)."""

    def compute(self, image_features, text_features, scale, negatives=None) -> torch.Tensor:
        return _DiscoLoss.apply(image_features, text_features, scale, negatives, self.group)
