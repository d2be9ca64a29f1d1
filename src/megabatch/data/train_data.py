"""The training data of a run: which shards, how many samples, one loader per epoch."""

from __future__ import annotations

from ..config import parse_optional_count
from .digits import ensure_digits
from .pipeline import (
    EpochBatches,
    RawSubBatches,
    SampleDecoder,
    count_samples,
    expand_urls,
    make_epoch_loader,
)
from .transforms import train_transform


class TrainData:
    """Shards named by ``data.train.urls`` (``null``: the embedded digits, built on first use)."""

    def __init__(self, cfg, tokenize, image_size: int, seed: int):
        urls = cfg.train.urls or ensure_digits(cfg.cache_dir)["train"]
        self.urls = expand_urls(urls, "data.train.urls")
        self.num_samples = parse_optional_count(cfg.train.get("num_samples"), "data.train.num_samples")
        if self.num_samples is None:
            self.num_samples = count_samples(self.urls, "data.train.urls")
        self.cfg, self.tokenize, self.seed = cfg, tokenize, seed
        self.transform = train_transform(image_size, **cfg.train.augment)

    def loader(self, epoch: int, start_batch: int, rank_batch: int, rank: int, world_size: int,
               num_batches: int, sub_batch: int | None = None, keep_raw: bool = False):
        """Sub-batches ``(images, texts, raw)`` of global batches ``start_batch .. num_batches-1``
        of ``epoch`` for ``rank`` (``rank_batch / sub_batch`` per global batch)."""
        dataset = EpochBatches(
            self.urls,
            transform=self.transform,
            tokenize=self.tokenize,
            rank_batch=rank_batch,
            rank=rank,
            world_size=world_size,
            num_batches=num_batches,
            seed=self.seed,
            epoch=epoch,
            start_batch=start_batch,
            shuffle_buffer=int(self.cfg.train.shuffle_buffer),
            sub_batch=sub_batch,
            keep_raw=keep_raw,
        )
        return make_epoch_loader(dataset, int(self.cfg.num_workers))

    def redecode(self, raw_sub_batches: list, epoch: int):
        """Iterate the image tensors of kept sub-batches again, in order, decoded by the loader
        workers with the same per-sample augmentation as the first time."""
        from torch.utils.data import DataLoader

        workers = int(self.cfg.num_workers)
        return iter(DataLoader(
            RawSubBatches(raw_sub_batches, SampleDecoder(self.transform, self.seed, epoch)),
            batch_size=None, num_workers=workers, prefetch_factor=2 if workers else None,
        ))
