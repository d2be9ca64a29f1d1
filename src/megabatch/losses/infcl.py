"""Inf-CL: the similarity matrix is never materialised, on one GPU or across a ring of them.

Each rank keeps its image rows; the text blocks travel around the ring (P2P send/recv posted
before the local tile work, so communication overlaps compute). One pass over each block gives
both directions: the row log-sum-exps (image->text) merge locally, the column log-sum-exps
(text->image) travel behind their text block and arrive back at its owner complete. Backward
recomputes the tiles; each block's column-gradient accumulator travels behind it the same way
(Inf-CL supplementary Algorithm 1). Memory is linear in b: the features, the gradient
accumulators, two ``[b_local]`` log-sum-exps and one stripe of tiles.

The tile work runs in ``kernels``: fused Triton kernels on CUDA (``impl=auto|triton``) or the
plain-torch reference of the same math (``impl=torch``, the CPU path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.gather import group_size
from ..distributed.ring import RingExchange
from ..kernels.torch_tiles import accumulation_dtype
from .base import TiledLoss


def _row_dots(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, chunk: int = 65536) -> torch.Tensor:
    """``(a * b).sum(1)`` in ``acc``, upcasting a chunk of rows at a time (no [b, c] fp32 copies)."""
    return torch.cat([(a[i : i + chunk].to(acc) * b[i : i + chunk].to(acc)).sum(1)
                      for i in range(0, a.shape[0], chunk)])


class _InfClLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, image_features, text_features, scale, negatives, group, stats_fn, grads_fn):
        world, rows = group_size(group), image_features.shape[0]
        ring = RingExchange(group) if world > 1 else None
        acc = accumulation_dtype(image_features.dtype)
        row_lse = torch.full((rows,), float("-inf"), dtype=acc, device=image_features.device)
        # hard negatives travel with their rank's texts as further columns: the rows' log-sum-exps take
        # them in, their own column log-sum-exps (computed alongside) are not used
        block = text_features if negatives is None else torch.cat([text_features, negatives])
        texts, pending_lse = block, None
        for step in range(world):
            pending_texts = ring.start(texts) if step < world - 1 else None  # next block, in flight
            block_rows, block_cols = stats_fn(image_features, texts, scale)
            row_lse = torch.logaddexp(row_lse, block_rows.to(acc))
            col_lse = block_cols.to(acc)
            if pending_lse is not None:  # the earlier ranks' share of this block's columns
                col_lse = torch.logaddexp(col_lse, pending_lse.wait())
            if ring is not None:  # onward behind the block; after the last step, to its owner
                pending_lse = ring.start(col_lse)
            if pending_texts is not None:
                texts = pending_texts.wait()
        if ring is not None:
            col_lse = pending_lse.wait()  # own texts' column log-sum-exp, every rank's rows in it
        positives = _row_dots(image_features, text_features, acc) * scale.to(acc)
        if negatives is not None:  # the negatives' columns have no text->image term: +inf zeroes their P_col
            col_lse = torch.cat([col_lse[:rows], torch.full_like(col_lse[rows:], float("inf"))])
        local = (row_lse.sum() + col_lse[:rows].sum() - 2 * positives.sum()) / (2 * rows)
        total = local.clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        ctx.save_for_backward(image_features, block, scale, row_lse, col_lse)
        ctx.group, ctx.world, ctx.grads_fn, ctx.negatives = group, world, grads_fn, negatives is not None
        return total / world  # fp32 (float64 for float64 inputs)

    @staticmethod
    def backward(ctx, grad_output):
        image_features, block, scale, row_lse, col_lse = ctx.saved_tensors
        world, rows = ctx.world, image_features.shape[0]
        ring = RingExchange(ctx.group) if world > 1 else None
        acc = row_lse.dtype
        weight = grad_output.to(acc) / (2 * rows)  # W-scaled per-rank gradient (base.py contract)
        # one rank: each row block's image gradient is complete after the single block call, so
        # the kernels return it in the features' dtype (no fp32 [b, c] buffer); a ring sums
        # every step's contribution in an fp32 accumulator
        d_image = None if world == 1 else \
            torch.zeros(image_features.shape, dtype=acc, device=image_features.device)
        d_scale = torch.zeros((), dtype=acc, device=image_features.device)
        texts, texts_lse, pending_acc = block, col_lse, None
        for step in range(world):
            if step < world - 1:  # the next block and its column log-sum-exp, in flight
                pending_texts, pending_texts_lse = ring.start(texts), ring.start(texts_lse)
            # this rank's share of the held block's column gradients: [b_local, c]
            d_texts = torch.zeros(texts.shape, dtype=acc, device=texts.device)
            block_d_image, _, block_d_scale = ctx.grads_fn(
                image_features, texts, scale, row_lse, texts_lse, weight, step == 0, d_rows=d_image,
                d_cols=d_texts, rows_dtype=image_features.dtype if world == 1 else None)
            d_image, d_scale = block_d_image, d_scale + block_d_scale
            if pending_acc is not None:  # earlier ranks' share arrived while we computed
                d_texts += pending_acc.wait()
            if ring is not None:
                pending_acc = ring.start(d_texts)  # onward; after the last step: to the owner
            if step < world - 1:
                texts, texts_lse = pending_texts.wait(), pending_texts_lse.wait()
        d_text = pending_acc.wait() if ring is not None else d_texts
        del d_texts, pending_acc, block_d_image, _
        # cast one accumulator at a time, freeing each: peak stays one fp32 [b_local, c] lower
        d_text = d_text.to(block.dtype)
        d_image = d_image.to(image_features.dtype)
        d_negatives = d_text[rows:] if ctx.negatives else None
        return (d_image, d_text[:rows], d_scale.to(scale.dtype).reshape(scale.shape), d_negatives,
                None, None, None)


class InfClLoss(TiledLoss):
    """Inf-CL ring loss (options: ``base.TiledLoss``)."""

    def compute(self, image_features, text_features, scale, values_in=None, negatives=None) -> torch.Tensor:
        stats_fn, grads_fn = self.tile_functions(image_features.device, "block_stats", "block_grads",
                                                 values_in=values_in)
        return _InfClLoss.apply(image_features, text_features, scale, negatives, self.group, stats_fn, grads_fn)
