"""Inf-CL: the similarity matrix is never materialised, on one GPU or across a ring of them.

Each rank keeps its rows. Feature blocks travel around the ring (P2P send/recv posted before the
local tile work, so communication overlaps compute) while row log-sum-exps are merged online.
Backward recomputes the tiles and sends each block's column-gradient accumulator around the ring
behind it (Inf-CL supplementary Algorithm 1), so it arrives back at its owner with every rank's
contribution. Memory is linear in b: the features, two ``[b_local]`` log-sum-exps, one tile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.gather import group_size
from ..distributed.ring import RingExchange
from ..kernels.tiles import accumulation_dtype
from .base import ContrastiveLoss


class _InfClLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, image_features, text_features, scale, group, tile, tiles):
        world, rows = group_size(group), image_features.shape[0]
        lse_fn = tiles.block_lse
        ring = RingExchange(group) if world > 1 else None
        block = torch.stack([image_features, text_features])  # [2, b_local, c], travels the ring
        acc = accumulation_dtype(image_features.dtype)
        lse_image = torch.full((rows,), float("-inf"), dtype=acc, device=block.device)
        lse_text = lse_image.clone()
        for step in range(world):
            pending = ring.start(block) if step < world - 1 else None  # next block, in flight
            lse_image = torch.logaddexp(lse_image, lse_fn(image_features, block[1], scale, tile))
            lse_text = torch.logaddexp(lse_text, lse_fn(text_features, block[0], scale, tile))
            if pending is not None:
                block = pending.wait()
        positives = (image_features.to(acc) * text_features.to(acc)).sum(1) * scale.to(acc)
        local = ((lse_image - positives).sum() + (lse_text - positives).sum()) / (2 * rows)
        total = local.clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        ctx.save_for_backward(image_features, text_features, scale, lse_image, lse_text)
        ctx.group, ctx.world, ctx.tile, ctx.tiles = group, world, tile, tiles
        return total / world  # fp32 (float64 for float64 inputs)

    @staticmethod
    def backward(ctx, grad_output):
        image_features, text_features, scale, lse_image, lse_text = ctx.saved_tensors
        world, tile, rows = ctx.world, ctx.tile, image_features.shape[0]
        grads_fn = ctx.tiles.block_grads
        ring = RingExchange(ctx.group) if world > 1 else None
        acc = lse_image.dtype
        weight = grad_output.to(acc) / (2 * rows)
        block = torch.stack([image_features, text_features])
        d_image = torch.zeros(image_features.shape, dtype=acc, device=block.device)
        d_text, d_scale = torch.zeros_like(d_image), torch.zeros((), dtype=acc, device=block.device)
        pending_acc = None  # the column-gradient accumulator travelling behind the features
        for step in range(world):
            pending_block = ring.start(block) if step < world - 1 else None
            own = step == 0  # the first block is this rank's own: it holds the positives
            # this rank's column gradients for the held block: [2, b_local, c] (images, texts)
            columns = torch.zeros(block.shape, dtype=acc, device=block.device)
            _, _, ds_i = grads_fn(image_features, block[1], scale, lse_image, tile, weight, own,
                                  d_rows=d_image, d_cols=columns[1])
            _, _, ds_t = grads_fn(text_features, block[0], scale, lse_text, tile, weight, own,
                                  d_rows=d_text, d_cols=columns[0])
            d_scale += ds_i + ds_t
            if pending_acc is not None:  # earlier ranks' share arrived while we computed
                columns += pending_acc.wait()
            if ring is not None:
                pending_acc = ring.start(columns)  # onward; after the last step: to the owner
            if pending_block is not None:
                block = pending_block.wait()
        own_columns = pending_acc.wait() if ring is not None else columns
        d_image += own_columns[0]
        d_text += own_columns[1]
        return (d_image.to(image_features.dtype), d_text.to(text_features.dtype),
                d_scale.to(scale.dtype).reshape(scale.shape), None, None, None)


class InfClLoss(ContrastiveLoss):
    """Inf-CL ring loss. ``tile``: rows/columns per tile inside a GPU (memory tile^2 per tile)."""

    def __init__(self, tile: int = 4096, group=None):
        super().__init__(group)
        if tile <= 0:
            raise ValueError(f"loss.tile={tile} must be positive")
        self.tile = tile

    def compute(self, image_features, text_features, scale) -> torch.Tensor:
        from .. import kernels

        return _InfClLoss.apply(image_features, text_features, scale, self.group, self.tile, kernels)
