"""An exponential moving average of the trained weights (``ema.decay``), kept beside the model.

``WeightAverage`` holds a copy of every trainable parameter (fp32 where the weights are in half
precision, so that a decay of 0.9999 is not rounded away) and, after each optimizer step
(``ema.every`` steps apart), moves it toward the weights:

    average <- decay_t x average + (1 - decay_t) x weights,   decay_t = min(decay, 1 - (1 + t)^-power)

with ``t`` the updates made before this one and ``power`` = ``ema.warmup_power`` (timm's ``ModelEmaV3``
warm-up; null: ``decay_t = decay`` from the second update). The first update copies the weights
(``decay_t = 0``), so an average started on a resumed run, or from a checkpoint without one, begins
at the weights it resumed, not at the initialisation. Under FSDP2 each rank averages its own shards
(the copies are ``DTensor``s like the weights); the update is a few foreach kernels on the device and
reads nothing back to the host. A skipped update (a non-finite step) still counts: the weights did not
move, and the average moves toward them as it would.

``swapped()`` puts the average into the model for an evaluation and the weights back after it;
``state_dict()``'s ``weights`` (name -> tensor) go into a checkpoint beside the model's (a sharded
checkpoint writes them through DCP, each rank its shards: ``Checkpointer``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from ...distributed.fsdp import local

log = logging.getLogger("megabatch")

class WeightAverage:
    """The moving average of ``model``'s trainable parameters: ``decay`` (e.g. 0.9999), an update every
    ``every`` optimizer steps (``step()`` after each one), ``warmup_power`` (null: no warm-up)."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup_power: float | None = 0.6667):
        self.decay, self.every, self.warmup_power = float(decay), int(every), warmup_power
        named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        with torch.no_grad():  # fp32 copies of half-precision weights; DTensors stay DTensors (sharded)
            self.average = [param.detach().to(torch.float32 if param.dtype in (torch.bfloat16, torch.float16)
                                               else param.dtype, copy=True) for param in self.params]
        self.updates = 0  # averaging updates made
        self.steps = 0    # optimizer steps seen

    def decay_at(self, update: int) -> float:
        """The decay of the update that follows ``update`` earlier ones (0 for the first: a copy)."""
        if update == 0:
            return 0.0
        if self.warmup_power is None:
            return self.decay
        return min(self.decay, 1.0 - (1.0 + update) ** -float(self.warmup_power))

    @torch.no_grad()
    def step(self) -> None:
        """After an optimizer step: every ``every``-th one, the average moves toward the weights
        (on the device, no host sync)."""
        self.steps += 1
        if self.steps % self.every:
            return
        weight = 1.0 - self.decay_at(self.updates)
        self.updates += 1
        averages = [local(average) for average in self.average]
        params = [local(param) for param in self.params]
        if any(a.dtype != p.dtype for a, p in zip(averages, params, strict=True)):  # half-precision weights
            params = [p.to(a.dtype) for a, p in zip(averages, params, strict=True)]
        torch._foreach_lerp_(averages, params, weight)

    @contextlib.contextmanager
    def swapped(self):
        """The average in the model's parameters for the block (an evaluation, an export), the
        weights put back after it (a copy of them held meanwhile)."""
        params = [local(param) for param in self.params]
        with torch.no_grad():
            kept = [param.clone() for param in params]
            torch._foreach_copy_(params, [local(average) for average in self.average])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, kept)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The average by parameter name (the tensors themselves: a sharded checkpoint reads into them)."""
        return dict(zip(self.names, self.average, strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "every": self.every, "warmup_power": self.warmup_power,
                "updates": self.updates, "steps": self.steps, "weights": self.tensors()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The counters and the average (whole tensors of a ``.pt`` into this rank's shards where the
        model is sharded; a sharded checkpoint's were read in place, by DCP). A parameter the file
        does not hold (a tower unfrozen since) starts from the weights at the next update's copy."""
        if float(state["decay"]) != self.decay or int(state["every"]) != self.every:
            log.info("ema: the checkpoint's average was made with decay %s every %s step(s); it goes on with "
                     "ema.decay=%s ema.every=%s", state["decay"], state["every"], self.decay, self.every)
        self.updates, self.steps = int(state["updates"]), int(state["steps"])
        saved = state["weights"]
        missing = [name for name in self.names if name not in saved]
        if missing:
            log.warning("ema: the checkpoint has no average of %d parameter(s) (%s ...): the average restarts from "
                        "the weights at the next update", len(missing), missing[0])
            self.updates = 0
        with torch.no_grad():
            for name, average in zip(self.names, self.average, strict=True):
                if name in saved and saved[name] is not average:
                    copy_into(average, saved[name])


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``source`` (a whole tensor, or a DTensor) into ``target`` (a plain tensor or this rank's shard of a DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        if not isinstance(source, DTensor):
            source = distribute_tensor(source.to(target.device, target.dtype), target.device_mesh, target.placements)
        target.to_local().copy_(source.redistribute(target.device_mesh, target.placements).to_local())
    else:
        target.copy_(source.full_tensor() if isinstance(source, DTensor) else source)
