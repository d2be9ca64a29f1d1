"""Gathers of per-rank feature blocks, with and without autograd."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group=None) -> int:
    """World size of ``group`` (1 without an initialised process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def check_equal_batch(features: torch.Tensor, group=None) -> None:
    """Raise unless every rank of ``group`` holds the same number of rows (a host sync)."""
    world = group_size(group)
    if world == 1:
        return
    rows = torch.tensor([features.shape[0]], device=features.device)
    sizes = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(sizes, rows, group=group)
    sizes = [int(s.item()) for s in sizes]
    if len(set(sizes)) != 1:
        raise ValueError(
            f"contrastive losses need the same batch on every rank; got per-rank sizes {sizes}"
        )


def gather_no_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``[b_local, ...]`` -> ``[world * b_local, ...]`` in rank order, outside autograd."""
    world = group_size(group)
    if world == 1:
        return tensor.detach()
    out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_into_tensor(out, tensor.detach().contiguous(), group=group)
    return out


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: all-gather. Backward: sum the gathered gradient over ranks, keep the local rows.

    When every rank computes the same loss L from the gathered tensor, the local rows receive
    ``world * dL/d(local)``, which DDP's mean turns into the exact gradient.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.rows = tensor.shape[0]
        return gather_no_grad(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        # reduce-scatter would move less data, but gloo lacks it; all-reduce works on both.
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        rank = group_rank(ctx.group)
        return grad[rank * ctx.rows : (rank + 1) * ctx.rows], None


def all_gather_with_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all-gather: ``[b_local, c]`` -> ``[world * b_local, c]`` in rank order."""
    if group_size(group) == 1:
        return tensor
    return _AllGatherWithGrad.apply(tensor, group)


def global_mean_value(local_loss: torch.Tensor, group=None) -> torch.Tensor:
    """``local_loss`` with its *value* replaced by the mean over ranks and its gradient unchanged.

    Row-sharded losses compute ``loss_r`` (their rows' share); the global loss is the mean over
    ranks. This returns that global value on every rank (one all-reduce of a scalar) while the
    backward still differentiates ``loss_r``, which is what the loss contract asks for.
    """
    world = group_size(group)
    if world == 1:
        return local_loss
    total = local_loss.detach().clone()
    dist.all_reduce(total, group=group)
    return local_loss + (total / world - local_loss.detach())
