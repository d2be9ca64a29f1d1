"""Evaluation on every rank together: each rank encodes every world-th item of a set (item ``i`` on rank
``i % world``), and the features, predictions or counts come back to every rank in the set's order, so the
numbers are those of one rank reading the whole set.

A model sharded by FSDP gathers its weights from every rank at each forward pass, so there the ranks must run as
many forward passes: ``Ranks.encode`` gives a rank whose items ran out a one-row batch of zeros to encode (and
throws its output away) while another still has items. An unsharded model (one process, DDP's ranks, or
``scripts/evaluate.py`` under torchrun) encodes alone on each rank.

With one process every function here is the plain loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    lockstep: bool = False  # FSDP: every rank runs as many forward passes

    @classmethod
    def of(cls, model=None) -> Ranks:
        """The ranks of the running process group (one process without one); ``lockstep`` where ``model`` is
        sharded by FSDP."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        from ..distributed.fsdp import is_sharded

        return cls(dist.get_rank(), dist.get_world_size(), lockstep=model is not None and is_sharded(model))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def take(self, items: Sequence) -> list:
        """This rank's items of ``items``: every world-th, from its rank."""
        return list(items[self.rank::self.world])

    def gather(self, value: Any) -> list:
        """``value`` of every rank, in rank order (any picklable value; tensors come back on the CPU)."""
        if self.world == 1:
            return [value]
        values: list = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def interleave(self, mine: torch.Tensor) -> torch.Tensor:
        """The rows of every rank's ``take`` (or ``mine``) put back in the set's order: row ``j`` of rank ``r``
        is the set's item ``j * world + r``."""
        if self.world == 1:
            return mine
        parts = self.gather(mine.cpu())
        whole = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
        for rank, part in enumerate(parts):
            if len(part):
                whole[rank::self.world] = part
        return whole.to(mine.device)

    def in_order(self, mine: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, each tagged with its item's index in the set (``indices``), put in the set's order:
        for rows read by loader workers, whose batches come in the workers' turn, not the set's."""
        parts = self.gather((mine.cpu(), indices.cpu())) if self.world > 1 else [(mine.cpu(), indices.cpu())]
        rows = torch.cat([part for part, _ in parts if len(part)] or [mine.cpu()])
        order = torch.cat([index for _, index in parts]).argsort(stable=True)
        return rows[order].to(mine.device)

    def interleave_list(self, mine: list) -> list:
        """``interleave`` for a list of Python values (captions, outcomes)."""
        if self.world == 1:
            return mine
        parts = self.gather(mine)
        whole: list = [None] * sum(len(p) for p in parts)
        for rank, part in enumerate(parts):
            whole[rank::self.world] = part
        return whole

    def sum(self, values: dict[str, torch.Tensor | int | float]) -> dict:
        """Each entry summed over the ranks (counts, per-class tallies)."""
        if self.world == 1:
            return values
        parts = self.gather({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()})
        return {key: sum(part[key] for part in parts) for key in values}

    def encode(self, encode: Callable[[torch.Tensor], torch.Tensor],
               batches: Iterable[tuple[torch.Tensor, Any]], device: torch.device) -> Iterator[tuple[torch.Tensor,
                                                                                                      Any]]:
        """``(encode(inputs), extra)`` for this rank's ``(inputs, extra)`` batches. In lockstep, while any rank
        has a batch, a rank that has none encodes a one-row batch of zeros shaped like the others' (its output
        is dropped), so that every rank runs as many forward passes."""
        if not self.lockstep:
            for inputs, extra in batches:
                yield encode(inputs.to(device, non_blocking=True)), extra
            return
        batches = iter(batches)
        while True:
            item = next(batches, None)
            shapes = self.gather(None if item is None else (tuple(item[0].shape[1:]), item[0].dtype))
            if all(shape is None for shape in shapes):
                return
            if item is not None:
                yield encode(item[0].to(device, non_blocking=True)), item[1]
                continue
            shape, dtype = next(shape for shape in shapes if shape is not None)
            encode(torch.zeros((1, *shape), dtype=dtype, device=device))


    def features(self, encode: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[tuple[torch.Tensor, Any]],
                 device: torch.device) -> torch.Tensor:
        """This rank's features of its batches (``encode``'s outputs, float32), concatenated in order."""
        mine = [features.float() for features, _ in self.encode(encode, batches, device)]
        return torch.cat(mine) if mine else torch.zeros((0, 0), device=device)


def progress(iterable: Iterable, ranks: Ranks, description: str, total: int | None = None) -> Iterable:
    """A progress bar on rank 0 (to stderr, gone when done) over ``iterable``; the iterable itself elsewhere."""
    if not ranks.main:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=description, total=total, leave=False, dynamic_ncols=True, unit="batch",
                mininterval=2.0)


def batched(items: Sequence, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])
