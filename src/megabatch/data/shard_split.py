"""Shard-level splitting for LAION-scale data: each loader worker of each rank reads its own shards.

Two modes (``data.train.mode``):

- ``epoch``: the shards, shuffled per epoch from the seed, are dealt to the ``ranks x workers``
  slots; every sample is read by one slot only, once per epoch. Every slot yields the same number
  of sub-batches, fixed up front from ``sizes.json`` (the smallest possible slot decides), so all
  ranks take the same number of steps and DDP never hangs; with equal shards dealt evenly, every
  sample is used exactly once per epoch.
- ``resampled``: an endless stream per slot; each next shard is drawn with replacement, first a
  source by ``data.train.weights``, then a shard of it uniformly. The draws depend only on (seed,
  epoch, rank, worker), so a run repeats exactly from the same seed.

Either way a resumed run skips the sub-batches it already trained on without decoding them, and
a sample's augmentation is seeded by its (epoch, position), as in the position-split loader.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import webdataset as wds
from torch.utils.data import get_worker_info

from .position_split import PositionSplitBatches
from .samples import decode_pair
from .tars import tar_samples


def slot_quota(sizes: list[int], slots: int, sub_batch: int) -> int:
    """Sub-batches every slot can always fill in epoch mode: the ``len(sizes) // slots`` smallest
    shards are the least any slot receives, whatever the shuffle."""
    per_slot = len(sizes) // slots
    return sum(sorted(sizes)[:per_slot]) // sub_batch


class ShardBatches(PositionSplitBatches):
    """Sub-batches of one epoch (or resampled stretch) for one rank, split across shards.

    ``sources``: lists of shard urls; ``weights``: one per source (resampled mode); ``quota``:
    sub-batches each worker yields (epoch mode); ``total``: sub-batches this rank takes in all.
    """

    def __init__(self, sources: list[list[str]], *, mode: str, weights: list[float] | None,
                 num_workers: int, total: int, **kwargs):
        super().__init__([url for source in sources for url in source], **kwargs)
        self.sources, self.mode = sources, mode
        self.weights = weights or [1.0] * len(sources)
        self.loader_workers, self.total = max(1, num_workers), total

    def _shards(self, slot: int, slots: int) -> tuple[Iterator[str], list[str]]:
        """This slot's shards, and the fallback read only if those run short of its quota
        (unreadable or miscounted shards): in epoch mode, the other slots' shards in the epoch's
        order (samples taken from them count as padded); resampled mode draws forever, no fallback."""
        epoch_seed = self.seed * 100_003 + self.epoch
        if self.mode == "epoch":
            shards = list(self.urls)
            random.Random(epoch_seed).shuffle(shards)
            own = shards[slot::slots]
            return iter(own), [url for url in shards[slot + 1:] + shards[:slot + 1] if url not in own]
        return self._resampled(random.Random(epoch_seed * 7_919 + slot)), []

    def _resampled(self, rng: random.Random) -> Iterator[str]:
        while True:  # draw with replacement, a source by weight, then a shard
            source = rng.choices(self.sources, weights=self.weights)[0]
            yield source[rng.randrange(len(source))]

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info else 0
        workers = self.loader_workers
        per_batch = self.rank_batch // self.sub_batch
        consumed = self.start_batch * per_batch  # this rank's sub-batches already trained on
        # DataLoader worker i serves the (consumed + i)-th sub-batch next: rotate the slots so a
        # resumed run continues each slot's stream where it stopped
        logical = (worker + consumed) % workers
        mine_total = self.total // workers + (logical < self.total % workers)
        mine_done = consumed // workers + (logical < consumed % workers)
        slot, slots = self.rank * workers + logical, self.world_size * workers
        self.worker = worker
        own, fallback = self._shards(slot, slots)
        read = tar_samples(self.stats.handler)
        stream = wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer,
                             seed=(self.seed * 100_003 + self.epoch) * 7_919 + slot)(
            read(iter({"url": url} for url in own)))
        borrowed = read(iter({"url": url} for url in fallback))  # only pulled once the slot's own ran dry
        stream, borrowed_urls = itertools.chain(stream, borrowed), set(fallback)
        skip = mine_done * self.sub_batch
        produced, pending = mine_done, []
        self.stats.give_up_after = 2 * len(self.urls) + 1  # resampled: every shard failed, twice over
        for index, raw in enumerate(stream):
            self.stats.got_sample()
            if produced >= mine_total:
                break
            if index < skip:
                continue  # already trained on before a resume: not decoded
            if borrowed_urls and raw.get("__url__") in borrowed_urls:
                self.stats.padded += 1  # borrowed from another slot's shards: this slot's ran short
            position = index * slots + slot  # unique within the epoch: seeds the augmentation
            pair = decode_pair(raw, self.stats, self.decoder.decode, self.decoder.captions, position,
                                   self.decoder.image_keys)
            if pair is None:
                continue
            image_bytes, image, caption = pair
            pending.append((image_bytes, position, self.decoder(image, position), caption))
            if len(pending) == self.sub_batch:
                yield self._collate(pending)
                produced, pending = produced + 1, []
        while produced < mine_total:  # the shards ran short (broken or miscounted): pad
            yield self._collate(pending)
            produced, pending = produced + 1, []
