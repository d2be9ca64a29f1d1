"""``data.train.negatives_key``: hard negatives (NegCLIP), each sample's K captions that do not describe it,
extra columns of the image->text softmax. Their features come from the text tower: in a one-pass step with the
captions, in one forward; with GradCache in chunks of ``sub_batch`` rows after the captions (sorted by length and
cut where captions are, ``text_trim``), each with its RNG state, replayed before the sub-batches.

Config checks (``validate``, before anything is built): ``check_negatives`` (a softmax loss, no caption loss)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..gradcache import RngState, to_device
from .base import Objective


class HardNegatives(Objective):
    name = "negatives"

    def __init__(self):
        self.new_step()

    def new_step(self) -> None:
        self.pending: list[torch.Tensor] = []   # phase 1: each sub-batch's token ids [sub_batch x K, ctx], on the host
        self.features: torch.Tensor | None = None  # [b_rank x K, e], the chunks' rows in sample order
        self.chunks: list[torch.Tensor] = []    # token ids of each chunk (on the device), for the replay
        self.rng: list[RngState] = []
        self.order: torch.Tensor | None = None  # on the device: the chunks' rows, one after another
        self.grads: torch.Tensor | None = None
        self.sub_batch = 0

    # one pass: the negatives ride with the captions through one forward of the text tower
    def extra_texts(self, sub) -> torch.Tensor | None:
        return sub.negatives

    def loss_inputs_one_pass(self, sub, images, extra_features, autocast) -> dict[str, Any]:
        return {} if extra_features is None else {"negatives": extra_features.float()}

    # GradCache
    def encoded(self, sub, images, rows, total_rows, precision) -> None:
        if sub.negatives is not None:
            self.pending.append(sub.negatives)
            self.sub_batch = len(sub.texts)

    def rows(self, index: int) -> torch.Tensor:
        """The rows of chunk ``index`` in ``features`` (indices on the device)."""
        return self.order[index * self.sub_batch:(index + 1) * self.sub_batch]

    def encoded_all(self, model, encoded, precision) -> None:
        """This rank's negatives ``[b_rank x K, ctx]`` (sample i's K rows together) through the text tower in
        chunks of ``sub_batch`` rows; where captions are cut (``text_trim``) sorted by length first (on the host: no
        sync), each chunk cut to its longest. No graph is kept: every chunk is encoded again in the replay."""
        if not self.pending:
            return
        negatives, self.pending = torch.cat(self.pending), []
        keep, device, trim = encoded.replays, precision.device, encoded.replays.text_trim
        lengths = None if trim is None else trim.lengths(negatives)
        order = torch.arange(negatives.shape[0]) if lengths is None else torch.argsort(lengths, stable=True)
        self.order = to_device(order, device)
        for index, rows in enumerate(order.split(self.sub_batch)):
            chunk = negatives.index_select(0, rows)
            if trim is not None:
                chunk = chunk[:, :trim.bucket(int(lengths[rows].max()))].contiguous()
            chunk = to_device(chunk, device)
            self.rng.append(RngState.capture(device))
            with precision.autocast():
                _, chunk_features, *_ = model(None, chunk)
            if self.features is None:
                self.features = chunk_features.new_empty((negatives.shape[0], chunk_features.shape[1]),
                                                         dtype=encoded.text_features.dtype)
            self.features.index_copy_(0, self.rows(index), chunk_features.detach().to(self.features.dtype))
            if keep.texts:
                self.chunks.append(chunk)

    def loss_inputs(self, encoded) -> dict[str, Any]:
        return {} if self.features is None else {"negatives": self.features.float().requires_grad_()}

    def take_grads(self, grads: dict[str, torch.Tensor]) -> None:
        self.grads = grads.get("negatives")

    def replay_first(self, model, encoded, precision, sync) -> None:
        """Each chunk encoded again with its RNG state, its cached feature gradients back-propagated under
        ``sync.hold`` (the sub-batches after them synchronise)."""
        if self.features is None or not encoded.replays.texts:
            return
        for index, chunk in enumerate(self.chunks):
            self.rng[index].restore()
            with contextlib.nullcontext() if sync.hold is None else sync.hold():
                with precision.autocast():
                    _, features, *_ = model(None, chunk)
                (features.float() * self.grads[self.rows(index)]).sum().backward()
        self.new_step()
