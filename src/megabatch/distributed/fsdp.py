"""FSDP2 (``trainer.parallel=fsdp``): every parameter, gradient and AdamW moment is split across
the ranks, so a rank holds ``1 / world_size`` of the model's state instead of all of it; or with
``trainer.fsdp_shard_size`` (HSDP) across the ranks of one group (a node) and replicated across the
groups, so the weights' gathers stay within a node.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to each transformer block of both
towers, then to each tower (``clip.visual``, and ``clip.text`` where the text tower is a module of
its own), then to the whole ``ClipModel`` (the rest: open_clip CLIP's token and position
embeddings, ``ln_final``, ``text_projection``, the logit scale and bias). A block's weights are
gathered just before it runs and freed after it; its gradient is reduce-scattered after its
backward. With ``trainer.fsdp_reduce=step`` the gradients are reduce-scattered once per step, and
the weights, once gathered in a step, stay gathered for its later passes (``gathered_through``).

Mixed precision: with bf16 towers (``trainer.precision=bf16``) the blocks' and towers' weights are
gathered in bf16 (one cast per gather instead of one per matmul under autocast) and their gradients
reduced in fp32; the root group (the text embeddings) stays fp32. The logit scale and bias
(0-d: FSDP shards none) stay whole on every rank, their gradients averaged like DDP's.

Outside a forward the parameters are ``DTensor`` shards: ``full`` gives a small one's whole value.
``ClipModel.encode_image`` and ``encode_text`` (evaluation's entry points) gather like ``forward``.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of both towers: the items of every ``nn.ModuleList`` of at least two
    modules of one class that hold parameters (open_clip's ``resblocks``, a Hugging Face
    encoder's ``layer``), or ``nn.Sequential`` of such modules that have modules of their own (timm's ``blocks``: a
    NaFlex tower's), outermost lists only."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        kinds = {type(item) for item in module}
        composite = isinstance(module, nn.ModuleList) or all(any(True for _ in item.children()) for item in module)
        if len(kinds) == 1 and composite and all(any(True for _ in item.parameters()) for item in module):
            blocks.extend(module)
            inside.update(id(sub) for item in module for sub in item.modules())
    return blocks


def towers(model: nn.Module) -> list[nn.Module]:
    """The towers that are modules of their own: the image tower, and the text tower of a
    ``CustomTextCLIP`` (open_clip ``CLIP`` keeps its text tower's parts on itself)."""
    clip = model.clip
    return [tower for tower in (getattr(clip, "visual", None), getattr(clip, "text", None))
            if isinstance(tower, nn.Module)]


def shard_model(model: nn.Module, device: torch.device, bf16: bool, shard_size: int | None = None) -> int:
    """Shard ``model`` (a ``ClipModel``) in place across the default process group; returns the
    number of groups. Call before the optimizer is built (its parameters are replaced by shards).
    ``shard_size`` (``trainer.fsdp_shard_size``) smaller than the world: HSDP, on a 2-D mesh of
    ``world / shard_size`` replicas of ``shard_size`` ranks each (consecutive ranks: a node's), each
    replica holding the whole model in shards; FSDP reduce-scatters the gradients within a replica and
    all-reduces them across the replicas."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    world = dist.get_world_size()
    if shard_size is None or shard_size == world:
        mesh = init_device_mesh(device.type, (world,))
    else:
        mesh = init_device_mesh(device.type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    half = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    groups = transformer_blocks(model) + towers(model)
    for module in groups:
        fully_shard(module, mesh=mesh, mp_policy=half)
    # the root: the embeddings in fp32; the scalars (logit scale and bias: FSDP shards no 0-d
    # parameter) stay whole on every rank, their gradients averaged by reduce_replicated
    scalars = {param for param in model.parameters() if param.ndim == 0}
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(), ignored_params=scalars or None)
    for method in ("encode_image", "encode_text"):
        register_fsdp_forward_method(model, method)
    return len(groups) + 1


def reduce_replicated(model: nn.Module) -> None:
    """Average the gradients of the parameters FSDP left whole (the 0-d scalars) across the ranks,
    as it averages the shards' (call once per step, after the last backward)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None and not isinstance(p, DTensor)]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1).float() for grad in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, value in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
        grad.copy_(value.view_as(grad))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (sharded) parameter or gradient; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def gathered_through(model: nn.Module):
    """Inside, FSDP does not reshard a group after its forward or backward: the weights gathered for
    one pass stay for the next (GradCache's phase 1, then each replay's forward and backward), where
    FSDP's hooks leave them (a step of the tiny test model: 18 all-gathers against 81 with
    resharding). On exit every group is resharded, so that the optimizer's update reaches the next gather
    (``trainer.fsdp_reduce=step``, which holds the whole gradient meanwhile too; the memory plan
    counts both: ``parts.fsdp_step_bytes``)."""
    from torch.distributed.fsdp import FSDPModule

    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        model.set_reshard_after_backward(True)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """Backward passes inside accumulate unsharded gradients without reducing them; the next
    backward outside reduces the sum (``trainer.fsdp_reduce=step``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
