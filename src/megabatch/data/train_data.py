"""The training data of a run: which shards, how many samples, one loader per epoch."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

from omegaconf import DictConfig

from ..config import ConfigError
from ..config.run import DataSettings
from ..distributed.once import on_rank_zero
from .captions import CaptionKeys
from .digits import ensure_digits
from .image_features import ImageFeatureSpec
from .indexed_split import EpochOrder, IndexedBatches, IndexScan
from .naflex import NaFlexSpec
from .position_split import PositionSplitBatches, make_loader
from .shard_split import ShardBatches, slot_quota
from .tars import reads_locally
from .teacher_store import TeacherSpec
from .transforms import train_transform
from .urls import expand_urls, is_remote, shard_sizes
from .worker_start import PickledOnce

log = logging.getLogger(__name__)


SPLIT_REASONS = {
    "indexed": "indexed (local or mounted shards: read by random access, the same samples in the same order on "
               "any number of GPUs and loader workers, a resume exact)",
    "shard": "shard (streamed or compressed shards, or data.train.mode=resampled: each loader worker of each "
             "rank reads its own shards; a resume on another number of ranks x workers reads another order)",
}


def resolve_split(split: str, mode: str, urls: list[str]) -> str:
    """``data.train.split=auto``: ``shard`` for streams (``pipe:``, ``http(s)://``, ``s3://``, ...),
    compressed tars and ``mode=resampled``, which cannot be read at an offset; ``indexed`` for local or
    mounted ``.tar`` shards. Any other value as it is."""
    if split != "auto":
        return split
    if mode == "resampled" or any(is_remote(url) for url in urls):
        return "shard"
    # random access needs uncompressed tars: named so, and the first one is
    return "indexed" if all(url.endswith(".tar") for url in urls) and reads_locally(urls[0]) else "shard"


def naflex_spec(naflex, data: DataSettings, preprocess: dict, global_batch: int) -> NaFlexSpec | None:
    """What the data path makes for a NaFlex image tower (``naflex``: the model's ``NaFlexCfg``, ``None`` for a
    fixed-size tower): ``data.naflex``'s lengths, each at most the model's ``max_seq_len`` (a ``ConfigError``
    naming the keys otherwise), drawn per ``global_batch`` positions, the model's interpolation and
    ``data.train.augment``'s crop."""
    if naflex is None:
        return None
    seq_lens = data.naflex.seq_lens or (naflex.max_seq_len,)
    if max(seq_lens) > naflex.max_seq_len:
        raise ConfigError(f"data.naflex.seq_lens={list(seq_lens)}: longer than the model's model.image.max_seq_len="
                          f"{naflex.max_seq_len} (what it is compiled and measured for); raise max_seq_len or drop "
                          "the longer lengths")
    augment = data.train.augment  # RandomResizedCrop's ranges, the ratio's relative to each image's aspect ratio
    return NaFlexSpec(naflex.patch_size, naflex.max_seq_len, tuple(seq_lens), data.naflex.max_aspect,
                      preprocess["interpolation"], max(1, global_batch), tuple(augment.scale), tuple(augment.ratio))


class TrainData:
    """Shards named by ``data.train.urls`` (``null``: the embedded digits, built on first use).

    ``data.train.split``: ``auto`` (``resolve_split``: ``indexed`` for local shards, ``shard`` for
    streams), ``position`` (every rank and worker reads all shards and keeps its share
    by sample position: exact for any shard layout, for small data), ``shard`` (each worker of
    each rank reads its own shards: LAION scale, streams included; the order depends on ranks x
    workers) or ``indexed`` (local shards read by random access, each worker only its samples, in
    an order that depends on no rank or worker count: ``indexed_split.py``). ``data.train.mode``:
    ``epoch`` or ``resampled`` (shard split only). Several sources: ``urls`` as a list (or
    ``::``-joined) with ``weights``.
    """

    def __init__(self, data: DataSettings | DictConfig, tokenize, preprocess: dict, seed: int,
                 show_progress: bool = True, worker_start: str = "fork", naflex=None, global_batch: int = 1):
        cfg = data if isinstance(data, DataSettings) else DataSettings.of(data)  # parsed once: a run's are
        urls = cfg.train.urls or ensure_digits(cfg.cache_dir)["train"]
        patterns = [urls] if isinstance(urls, str) and "::" not in urls else (
            urls.split("::") if isinstance(urls, str) else list(urls))
        self.sources = [expand_urls(pattern, "data.train.urls") for pattern in patterns]
        self.urls = [url for source in self.sources for url in source]
        self.num_samples = cfg.train.num_samples
        self.cfg, self.tokenize, self.seed = cfg, tokenize, seed
        self.show_progress, self._sizes = show_progress, None
        self.worker_start = worker_start  # fork | forkserver: how the loaders' workers start (worker_start.py)
        if worker_start == "forkserver":  # each worker's dataset is pickled: the vocabulary once
            self.tokenize = PickledOnce(tokenize)
        self.mode = cfg.train.mode  # split and mode are checked with the rest of the config (config/schema.py)
        self.split = resolve_split(cfg.train.split, self.mode, self.urls)
        if self.num_samples is None:
            self.num_samples = sum(self.sizes)
        augment = cfg.train.augment
        # model.image_features=stored: each sample's stored features stand for its image (read, not decoded)
        self.image_features = self._stored_spec(cfg.train.image_features_key, ImageFeatureSpec,
                                                "data.train.image_features_key", "image features")
        self.transform = self.image_features or naflex_spec(naflex, cfg, preprocess, global_batch) or train_transform(
            preprocess["size"], preprocess["interpolation"], scale=list(augment.scale), ratio=list(augment.ratio))
        text_key = cfg.train.text_key
        self.teacher = self._stored_spec(cfg.train.teacher_key, TeacherSpec, "data.train.teacher_key",
                                         "teacher embeddings")
        self.captions = CaptionKeys(text_key if isinstance(text_key, str) else list(text_key),
                                    None if cfg.train.text_probs is None else list(cfg.train.text_probs),
                                    negatives_key=cfg.train.negatives_key, negatives=cfg.train.negatives,
                                    teacher=self.teacher)
        # the weights against the sources the URLs expand to
        self.weights = None if cfg.train.weights is None else list(cfg.train.weights)
        if cfg.train.split == "auto" and show_progress:
            log.info("data.train.split=auto: %s", SPLIT_REASONS[self.split])
        if self.weights is not None:
            if len(self.weights) != len(self.sources):
                raise ConfigError(f"data.train.weights has {len(self.weights)} values for "
                                  f"{len(self.sources)} sources in data.train.urls")
            if self.mode != "resampled":
                log.warning("data.train.weights has no effect in epoch mode (use mode=resampled)")

    def _stored_spec(self, key: str | None, kind, setting: str, what: str):
        """``data.train.teacher_key``'s stored embeddings (``kind`` ``TeacherSpec``) or
        ``data.train.image_features_key``'s stored image features (``ImageFeatureSpec``), described by the JSON file
        beside every source's shards (the same for all of them); ``None`` without ``key``."""
        if not key:
            return None
        specs = []
        for source in self.sources:
            if is_remote(source[0]):
                raise ConfigError(f"{setting}={key}: {source[0]} is a stream; stored {what} are read with local or "
                                  "mounted shards, the file that describes them beside them")
            specs.append(kind.load(Path(source[0]).expanduser().parent, key))
        if any(spec != specs[0] for spec in specs):
            raise ConfigError(f"{setting}={key}: the sources' descriptions of their stored {what} differ (written by "
                              "other models, or of other widths): give shards whose stored " + what + " come from "
                              "the same model(s)")
        return specs[0]

    @property
    def sizes(self) -> list[int]:
        """Each shard's sample count (urls.shard_sizes), read when first needed, by rank 0 for every
        rank (all ranks reach this at the same point: the config decides when). Streams have none:
        with ``data.train.num_samples`` set, an even split stands in for them (a slot whose shards
        run short reads on into the others', shard_split.py)."""
        if self._sizes is None:
            if self.num_samples is not None and any(is_remote(url) for url in self.urls):
                self._sizes = [self.num_samples // len(self.urls)] * len(self.urls)
            else:  # counted by rank 0 alone (a header scan of 41k shards once, not once per rank), in processes
                # forked from this one, also where the loader's workers come from the fork server: that server is
                # still importing at this point of a start (the first of 1,075 shards' counts came 21.8 s after
                # the count began, cold on an H200, the scans taking 4.4 s: docs/performance.md), and a pool
                # forked once costs a few page-table copies. The indexed split's scans build the tar indexes its
                # workers read (no second scan in the first epoch)
                scan = IndexScan(self.cfg.cache_dir) if self.split == "indexed" and self.cfg.cache_dir else None
                forked = multiprocessing.get_context("fork")
                self._sizes = on_rank_zero(lambda: shard_sizes(self.urls, "data.train.urls", self.cfg.cache_dir,
                                                               self.show_progress, mp_context=forked, scan=scan))
        return self._sizes

    @property
    def workers(self) -> int:
        return max(1, int(self.cfg.num_workers))

    def slots(self, world_size: int) -> int:
        """Ranks x loader workers: the slots ``data.train.split=shard`` deals the shards to."""
        return world_size * self.workers

    def steps_per_epoch(self, global_batch: int, world_size: int, sub_batch: int) -> int:
        """Steps in one epoch. Shard split: what the least-filled slot allows (see shard_split);
        position split and resampled mode: all samples, the last incomplete batch dropped."""
        if self.split == "shard" and self.mode == "epoch":
            slots = self.slots(world_size)
            if len(self.urls) < slots:
                raise ConfigError(
                    f"data.train.split=shard: {len(self.urls)} shards for {world_size} ranks x "
                    f"{self.workers} workers; use more shards, fewer data.num_workers, or split=position")
            quota = slot_quota(self.sizes, slots, sub_batch)
            per_step = global_batch // world_size // sub_batch
            return self.workers * quota // per_step
        if self.split == "indexed":
            return len(self.order(epoch=0)) // global_batch
        return self.num_samples // global_batch

    def order(self, epoch: int) -> EpochOrder:
        """The indexed split's sample order of ``epoch`` (its length is the same every epoch)."""
        return EpochOrder(self.sizes, self.seed, epoch, int(self.cfg.train.streams), int(self.cfg.train.shuffle_buffer))

    def loader(self, epoch: int, start_batch: int, rank_batch: int, rank: int, world_size: int,
               num_batches: int, sub_batch: int | None = None, keep_raw: bool = False,
               pin_memory: bool = False, gpu_decode: bool = False):
        """``SubBatch``es ``(images, texts, raw, stats, boxes)`` of global batches ``start_batch ..
        num_batches-1`` of ``epoch`` for ``rank`` (``rank_batch / sub_batch`` per global batch).
        ``pin_memory``: page-locked tensors, whose copy to the GPU does not wait for the GPU.
        ``gpu_decode``: JPEGs come encoded, as ``JpegBatch`` images (``data.decode=gpu``)."""
        sub_batch = sub_batch or rank_batch
        common = dict(transform=self.transform, tokenize=self.tokenize, rank_batch=rank_batch, rank=rank,
                      world_size=world_size, num_batches=num_batches, seed=self.seed, epoch=epoch,
                      start_batch=start_batch, shuffle_buffer=int(self.cfg.train.shuffle_buffer),
                      sub_batch=sub_batch, keep_raw=keep_raw, gpu_decode=gpu_decode, captions=self.captions)
        if self.split == "shard":
            dataset = ShardBatches(self.sources, mode=self.mode, weights=self.weights,
                                   num_workers=int(self.cfg.num_workers),
                                   total=num_batches * (rank_batch // sub_batch), **common)
        elif self.split == "indexed":
            dataset = IndexedBatches(self.urls, sizes=self.sizes, streams=int(self.cfg.train.streams),
                                     cache_dir=self.cfg.cache_dir, **common)
        else:
            dataset = PositionSplitBatches(self.urls, **common)
        return make_loader(dataset, int(self.cfg.num_workers), pin_memory, self.worker_start)
