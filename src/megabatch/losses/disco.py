"""DisCo-CLIP: gather without autograd, local rows, and one all-reduce of the gathered feature
gradients in backward (keeping the local slice). Memory b^2 / W per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.gather import gather_no_grad, group_rank, group_size
from .base import ContrastiveLoss


class _DiscoLoss(torch.autograd.Function):
    """Forward: ``loss_r`` from local rows against the gathered columns (both directions), and the
    mean over ranks as the value. Backward: local-row gradients directly; the column gradients of
    all ranks are summed by one all-reduce of ``[2, b, c]`` (a sum, not DisCo's "average", which
    would lose the factor W) and the local slice kept."""

    @staticmethod
    def forward(ctx, image_features, text_features, scale, group):
        world, rank, rows = group_size(group), group_rank(group), image_features.shape[0]
        all_images = gather_no_grad(image_features, group)
        all_texts = gather_no_grad(text_features, group)
        labels = torch.arange(rows, device=image_features.device) + rank * rows
        image_to_text = scale * image_features @ all_texts.T  # [b_local, b]
        text_to_image = scale * text_features @ all_images.T  # [b_local, b]
        lse_i, lse_t = image_to_text.logsumexp(1), text_to_image.logsumexp(1)
        positives = image_to_text.gather(1, labels[:, None]).squeeze(1)  # = text_to_image's
        local = ((lse_i - positives).sum() + (lse_t - positives).sum()) / (2 * rows)
        total = local.clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        ctx.save_for_backward(image_features, text_features, all_images, all_texts, scale, labels)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        ctx.probs = (torch.softmax(image_to_text, 1), torch.softmax(text_to_image, 1))
        return total / world

    @staticmethod
    def backward(ctx, grad_output):
        image_features, text_features, all_images, all_texts, scale, labels = ctx.saved_tensors
        p_image, p_text = ctx.probs
        del ctx.probs
        rows = image_features.shape[0]
        weight = grad_output / (2 * rows)
        g_image = p_image.clone()  # d loss_r / d logits, image->text rows
        g_image[torch.arange(rows), labels] -= 1
        g_image *= weight
        g_text = p_text.clone()
        g_text[torch.arange(rows), labels] -= 1
        g_text *= weight
        d_scale = (g_image * (image_features @ all_texts.T)).sum() + (
            g_text * (text_features @ all_images.T)).sum()
        # column gradients of every rank's loss w.r.t. the gathered features: [2, b, c]
        d_columns = torch.stack([scale * g_text.T @ text_features, scale * g_image.T @ image_features])
        if ctx.world > 1:
            dist.all_reduce(d_columns, group=ctx.group)
        local = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
        d_image = scale * g_image @ all_texts + d_columns[0, local]
        d_text = scale * g_text @ all_images + d_columns[1, local]
        return d_image, d_text, d_scale.reshape(scale.shape), None


class DiscoLoss(ContrastiveLoss):
    """DisCo-CLIP's distributed loss with a hand-written backward (see ``_DiscoLoss``)."""

    def compute(self, image_features, text_features, scale) -> torch.Tensor:
        return _DiscoLoss.apply(image_features, text_features, scale, self.group)
