"""Sub-batches cut by a token budget (``trainer.sub_batch_tokens``, a NaFlex tower's): the loader cuts each step into
the same number of sub-batches of the same number of samples, as many as fit the budget at the longest sequence
length; a step whose images are shorter has them joined, in order, into fewer and larger sub-batches of at most the
budget's patches (``TokenGroups``). The rows keep their order, so the features, the loss and the gradients are those
of any other cut (GradCache's contract); with the indexed and position splits every image of a step has the step's
length, so every rank joins alike (the same sub-batches on each, as FSDP's per-sub-batch reductions need)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .samples import EncodedImages, SubBatch


class TokenGroups:
    """``stream``'s sub-batches (``per_step`` of them make a step), joined ``joined(length)`` at a time, ``length``
    the patches a step's first sub-batch is packed to. ``step_sub_batches()``: how many the next step has (the step
    asks before taking them). Iterates like ``stream``; ``close`` closes it."""

    def __init__(self, stream: Iterator[SubBatch], per_step: int, joined: Callable[[int], int]):
        self.stream, self.per_step, self.joined = stream, per_step, joined
        self.left = 0          # the loader's sub-batches of this step not yet taken
        self.join = 1          # how many of them one sub-batch of this step joins
        self.first: SubBatch | None = None  # the step's first, taken to see its length

    def __iter__(self) -> TokenGroups:
        return self

    def step_sub_batches(self) -> int:
        """The sub-batches of the step about to be taken (its first loader sub-batch read to see its length)."""
        self._start_step()
        return self.left // self.join

    def _start_step(self) -> None:
        if self.left:
            return
        self.first = next(self.stream)
        self.left, self.join = self.per_step, self.joined(int(self.first.images.shape[1]))

    def __next__(self) -> SubBatch:
        self._start_step()
        parts = [] if self.first is None else [self.first]
        self.first = None
        parts += [next(self.stream) for _ in range(self.join - len(parts))]
        self.left -= self.join
        return join_sub_batches(parts)

    def close(self) -> None:
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()


def join_sub_batches(parts: list[SubBatch]) -> SubBatch:
    """``parts`` as one sub-batch, rows in order: packed patches (uint8 ``[n, L, row]``) padded with zero rows to the
    longest ``L`` (padding, by ``kernels/packed_patches.py``'s layout), captions, kept bytes, hard negatives and
    stored teacher embeddings concatenated; the last worker counts. Decoded on the GPU (``data.decode=gpu``), on the
    device, with the crop boxes concatenated where every part kept its own (else the replay draws them again)."""
    if len(parts) == 1:
        return parts[0]
    length = max(part.images.shape[1] for part in parts)
    rows = sum(len(part.images) for part in parts)
    first = parts[0].images
    pinned = first.device.type == "cpu" and torch.cuda.is_available() and first.is_pinned()  # copied to the GPU as is
    images = torch.zeros((rows, length, *first.shape[2:]), dtype=first.dtype, device=first.device, pin_memory=pinned)
    start = 0
    for part in parts:
        images[start:start + len(part.images), :part.images.shape[1]] = part.images
        start += len(part.images)
    stats = next((part.stats for part in reversed(parts) if part.stats), None)
    boxes = None if any(part.boxes is None for part in parts) else torch.cat([part.boxes for part in parts])
    return SubBatch(images, torch.cat([part.texts for part in parts]),
                    None if parts[0].raw is None else EncodedImages.join([part.raw for part in parts]), stats,
                    boxes=boxes,
                    negatives=_cat([part.negatives for part in parts]), teacher=_cat([part.teacher for part in parts]))


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)
