"""The position-split training loader, sized for exactness first: every rank (and loader worker)
reads the same shard stream, shuffled identically from (seed, epoch), and keeps its share of the
samples by position. Each epoch therefore uses every sample at most once across ranks, every rank
gets the same number of batches (no DDP hang), and a position in the stream identifies a sample,
so a resumed run skips the batches it already trained on without decoding them. LAION-scale data
uses the shard split instead (``shard_split.py``), which builds on this class.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..runtime.signals import ignore_stop_signals
from .captions import CaptionKeys
from .samples import EncodedImages, SampleDecoder, Stats, SubBatch, Texts, decode_pair
from .tars import tar_samples
from .worker_start import worker_context

log = logging.getLogger(__name__)


class PositionSplitBatches(IterableDataset):
    """This rank's sub-batches of one epoch: ``(images [sub_batch, 3, s, s] (with ``gpu_decode`` a
    ``JpegBatch``), texts [sub_batch, ctx], raw)``, ``rank_batch / sub_batch`` consecutive ones per global batch.

    ``raw`` is ``None``, or with ``keep_raw`` the sub-batch's encoded images and stream positions
    (``EncodedImages``), from which ``SampleDecoder`` re-creates the images exactly. ``num_batches`` global batches are
    produced (the last incomplete one is dropped); batches before ``start_batch`` are skipped
    without decoding. Sub-batch ``k`` (counted from the start) is built by loader worker
    ``k % num_workers``, matching the DataLoader's round-robin order.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        transform: Callable,
        tokenize: Callable[[list[str]], torch.Tensor],
        rank_batch: int,
        rank: int,
        world_size: int,
        num_batches: int,
        seed: int,
        epoch: int,
        start_batch: int = 0,
        shuffle_buffer: int = 1000,
        sub_batch: int | None = None,
        keep_raw: bool = False,
        gpu_decode: bool = False,
        captions: CaptionKeys | None = None,
    ):
        super().__init__()
        self.urls, self.tokenize = urls, tokenize
        # gpu_decode (data.decode=gpu): JPEGs are left encoded, with their crop boxes, for the GPU;
        # captions (data.train.text_key): which caption of each sample
        self.decoder = SampleDecoder(transform, seed, epoch, gpu=gpu_decode, captions=captions)
        self.rank_batch, self.rank, self.world_size = rank_batch, rank, world_size
        self.sub_batch = sub_batch or rank_batch
        self.num_batches, self.start_batch = num_batches, start_batch
        self.seed, self.epoch, self.shuffle_buffer = seed, epoch, shuffle_buffer
        self.keep_raw, self.gpu_decode = keep_raw, gpu_decode
        self.stats = Stats()

    def _stream(self) -> Iterator[dict]:
        epoch_seed = self.seed * 100_003 + self.epoch
        shards = list(self.urls)
        random.Random(epoch_seed).shuffle(shards)
        stream = tar_samples(self.stats.handler)(
            iter([{"url": url} for url in shards])
        )
        return wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, seed=epoch_seed)(stream)

    def _my_chunks(self, worker: int, num_workers: int) -> list[int]:
        """The sub-batch (chunk) indices this worker must produce, in order."""
        per_batch = self.rank_batch // self.sub_batch
        first, end = self.start_batch * per_batch, self.num_batches * per_batch
        return [c for c in range(first, end) if (c - first) % num_workers == worker]

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        global_batch = self.rank_batch * self.world_size
        per_batch = self.rank_batch // self.sub_batch
        first_chunk = self.start_batch * per_batch
        self.worker = worker
        expected = self._my_chunks(worker, num_workers)
        produced = 0
        pending: dict[int, list] = {chunk: [] for chunk in expected}  # each chunk's samples so far
        # an unusable sample at position p is stood in for by the next usable one at p + k x
        # global_batch (this rank's place in a later batch: never a second copy in this one)
        wanted: dict[int, list[int]] = {}  # stand-in position -> the chunks waiting for it

        def last_position(chunk: int) -> int:
            batch, first = divmod(chunk, per_batch)
            return batch * global_batch + self.rank + ((first + 1) * self.sub_batch - 1) * self.world_size

        def ready(chunk: int, read_up_to: int) -> bool:  # its places all read, no stand-in outstanding
            return read_up_to >= last_position(chunk) and not any(chunk in waiting for waiting in wanted.values())

        self.stats.count_shards = worker == 0  # every worker reads every shard: one reports them
        for position, raw in enumerate(self._stream()):
            self.stats.got_sample()
            while produced < len(expected) and ready(expected[produced], position - 1):
                yield self._collate(pending.pop(expected[produced]))
                produced += 1
            if produced == len(expected):
                break
            waiting = wanted.pop(position, [])
            batch_index = position // global_batch
            mine = None
            if batch_index < self.num_batches and position % self.world_size == self.rank \
                    and batch_index >= self.start_batch:
                # this rank's j-th sample of the global batch, in sub-batch (chunk) j // sub_batch
                j = (position % global_batch) // self.world_size
                chunk = batch_index * per_batch + j // self.sub_batch
                mine = chunk if (chunk - first_chunk) % num_workers == worker else None
            if mine is None and not waiting:
                continue
            pair = decode_pair(raw, self.stats, self.decoder.decode, self.decoder.captions, position,
                                   self.decoder.image_keys)
            if pair is None:
                for chunk in waiting + ([mine] if mine is not None else []):
                    wanted.setdefault(position + global_batch, []).append(chunk)
                continue
            image_bytes, image, caption = pair
            item = (image_bytes, position, self.decoder(image, position), caption)
            for chunk in waiting:
                self.stats.stand_in += 1
                pending[chunk].append(item)
            if mine is not None:
                pending[mine].append(item)
        # the stream may end early (a truncated shard) or before a stand-in: yield every expected
        # sub-batch (short ones padded) so that every rank yields the same number and DDP never waits
        while produced < len(expected):
            yield self._collate(pending.pop(expected[produced]))
            produced += 1

    def _collate(self, samples):
        if len(samples) < self.sub_batch:
            # unusable samples were skipped: repeat good ones (counted) to keep sub-batches equal
            missing = self.sub_batch - len(samples)
            self.stats.padded += missing
            self.stats.warn("padded", "sub-batch short of %d usable samples: repeating some (%s)", missing,
                            self.stats)
            samples = samples or list(getattr(self, "_last_samples", []))
            if not samples:
                unreadable = sorted(self.stats.broken_urls)
                raise RuntimeError("no usable sample to build a sub-batch from: "
                                   + (f"unreadable shards {unreadable}; " if unreadable else "")
                                   + f"{self.stats.as_dict()}")
            samples = (samples * (self.sub_batch // len(samples) + 1))[: self.sub_batch]
        self._last_samples = samples
        encoded = EncodedImages.from_bytes([s[0] for s in samples], [s[1] for s in samples]) \
            if self.keep_raw or self.gpu_decode else None
        images = self.decoder.collate([s[2] for s in samples], encoded)
        captions, negatives, teacher = [s[3] for s in samples], None, None
        if captions and isinstance(captions[0], Texts):  # hard negatives, stored teacher embeddings
            if captions[0].negatives is not None:
                negatives = self.tokenize([negative for held in captions for negative in held.negatives])
            if captions[0].teacher is not None:
                teacher = torch.from_numpy(np.stack([held.teacher for held in captions]))
            captions = [held.caption for held in captions]
        texts = self.tokenize(captions)
        raw = encoded if self.keep_raw else None
        return SubBatch(images, texts, raw, {"worker": self.worker, **self.stats.report()}, negatives=negatives,
                        teacher=teacher)


def make_loader(dataset: PositionSplitBatches, num_workers: int, pin_memory: bool = False,
                worker_start: str = "fork") -> DataLoader:
    """A DataLoader over ``dataset``'s ready-made batches. With ``pin_memory`` a background thread
    copies them into page-locked memory: a pageable copy to the GPU first waits for every kernel
    queued before it, so the loader could not run ahead of the encoder
    (measured in ``docs/bench/loader_copy_h200.json``). Its own generator: starting it draws the
    workers' base seed from that, not from the global one the towers draw from, so when a loader
    starts (the next epoch's starts before the boundary) changes no training randomness (the
    samples' augmentation is seeded by their position, ``transforms.py``). ``worker_start``: how its
    workers start, ``fork`` or ``forkserver`` (``data/worker_start.py``)."""
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        multiprocessing_context=worker_context(worker_start) if num_workers > 0 else None,
        prefetch_factor=4 if num_workers > 0 else None,
        worker_init_fn=ignore_stop_signals,  # the main process stops the run (train/trainer/stops.py)
        generator=torch.Generator().manual_seed(0),
    )
