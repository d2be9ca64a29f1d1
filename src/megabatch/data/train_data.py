"""The training data of a run: which shards, how many samples, one loader per epoch."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import re
import socket
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from ..config import ConfigError, parse_optional_count
from .digits import ensure_digits
from .pipeline import (
    EpochBatches,
    SampleDecoder,
    count_samples,
    expand_urls,
    make_epoch_loader,
)
from .shard_stream import ShardBatches, slot_quota
from .transforms import train_transform

log = logging.getLogger(__name__)


class TrainData:
    """Shards named by ``data.train.urls`` (``null``: the embedded digits, built on first use).

    ``data.train.split``: ``position`` (every rank and worker reads all shards and keeps its share
    by sample position: exact for any shard layout, for small data) or ``shard`` (each worker of
    each rank reads its own shards: LAION scale). ``data.train.mode``: ``epoch`` or ``resampled``
    (shard split only). Several sources: ``urls`` as a list (or ``::``-joined) with ``weights``.
    """

    def __init__(self, cfg, tokenize, image_size: int, seed: int):
        urls = cfg.train.urls or ensure_digits(cfg.cache_dir)["train"]
        patterns = [urls] if isinstance(urls, str) and "::" not in urls else (
            urls.split("::") if isinstance(urls, str) else list(urls))
        self.sources = [expand_urls(pattern, "data.train.urls") for pattern in patterns]
        self.urls = [url for source in self.sources for url in source]
        self.num_samples = parse_optional_count(cfg.train.get("num_samples"), "data.train.num_samples")
        if self.num_samples is None:
            self.num_samples = count_samples(self.urls, "data.train.urls")
        self.cfg, self.tokenize, self.seed = cfg, tokenize, seed
        self._redecoder = None
        self.spill: SpillFile | None = None
        self.transform = train_transform(image_size, **cfg.train.augment)
        self.split = cfg.train.get("split", "position")
        self.mode = cfg.train.get("mode", "epoch")
        self.weights = cfg.train.get("weights")
        if self.split not in ("position", "shard") or self.mode not in ("epoch", "resampled"):
            raise ConfigError("data.train.split must be position or shard, data.train.mode epoch "
                              f"or resampled; got split={self.split}, mode={self.mode}")
        if self.mode == "resampled" and self.split != "shard":
            raise ConfigError("data.train.mode=resampled needs data.train.split=shard")
        if self.weights is not None:
            if len(self.weights) != len(self.sources):
                raise ConfigError(f"data.train.weights has {len(self.weights)} values for "
                                  f"{len(self.sources)} sources in data.train.urls")
            if self.mode != "resampled":
                log.warning("data.train.weights has no effect in epoch mode (use mode=resampled)")

    @property
    def workers(self) -> int:
        return max(1, int(self.cfg.num_workers))

    def steps_per_epoch(self, global_batch: int, world_size: int, sub_batch: int) -> int:
        """Steps in one epoch. Shard split: what the least-filled slot allows (see shard_stream);
        position split and resampled mode: all samples, the last incomplete batch dropped."""
        if self.split == "shard" and self.mode == "epoch":
            slots = world_size * self.workers
            if len(self.urls) < slots:
                raise ConfigError(
                    f"data.train.split=shard: {len(self.urls)} shards for {world_size} ranks x "
                    f"{self.workers} workers; use more shards, fewer data.num_workers, or split=position")
            sizes = [count_samples([url], "data.train.urls") for url in self.urls]
            quota = slot_quota(sizes, slots, sub_batch)
            per_step = global_batch // world_size // sub_batch
            return self.workers * quota // per_step
        return self.num_samples // global_batch

    def loader(self, epoch: int, start_batch: int, rank_batch: int, rank: int, world_size: int,
               num_batches: int, sub_batch: int | None = None, keep_raw: bool = False,
               pin_memory: bool = False):
        """Sub-batches ``(images, texts, raw, stats)`` of global batches ``start_batch ..
        num_batches-1`` of ``epoch`` for ``rank`` (``rank_batch / sub_batch`` per global batch).
        ``pin_memory``: page-locked tensors, whose copy to the GPU does not wait for the GPU."""
        sub_batch = sub_batch or rank_batch
        common = dict(transform=self.transform, tokenize=self.tokenize, rank_batch=rank_batch, rank=rank,
                      world_size=world_size, num_batches=num_batches, seed=self.seed, epoch=epoch,
                      start_batch=start_batch, shuffle_buffer=int(self.cfg.train.shuffle_buffer),
                      sub_batch=sub_batch, keep_raw=keep_raw)
        if self.split == "shard":
            dataset = ShardBatches(self.sources, mode=self.mode, weights=self.weights,
                                   num_workers=int(self.cfg.num_workers),
                                   total=num_batches * (rank_batch // sub_batch), **common)
        else:
            dataset = EpochBatches(self.urls, **common)
        if keep_raw:  # fork the re-decode workers now, before phase 1 fills this process with bytes
            self._ensure_redecoder().start()
        return make_epoch_loader(dataset, int(self.cfg.num_workers), pin_memory)

    def _ensure_redecoder(self) -> Redecoder:
        if self._redecoder is None:
            self._redecoder = Redecoder(self.transform, self.seed, self.workers if self.cfg.num_workers else 0)
        return self._redecoder

    def spill_to(self, directory: str | None, rank: int) -> None:
        """Keep offloaded bytes in a file under ``directory`` (``None``: in host memory)."""
        self.spill = SpillFile(directory, rank) if directory else None

    def keep(self, raw: list | None) -> list | None:
        """What phase 1 holds on to for the replay: the bytes, or their place in the spill file."""
        return self.spill.keep(raw) if raw is not None and self.spill is not None else raw

    def release_kept(self) -> None:
        """A new step begins: the last step's replay is over, the spill file is rewritten from its start."""
        if self.spill is not None:
            self.spill.reset()

    def redecode(self, raw_sub_batches: list, epoch: int) -> Iterator[torch.Tensor]:
        """Iterate the image tensors of kept sub-batches again, in order, decoded with the same
        per-sample augmentation as the first time (by persistent worker processes)."""
        if self.spill is not None:
            self.spill.flush()
        return self._ensure_redecoder()(raw_sub_batches, epoch, self.spill.path if self.spill else None)

    def close(self) -> None:
        if self._redecoder is not None:
            self._redecoder.close()
            self._redecoder = None
        if self.spill is not None:
            self.spill.close()
            self.spill = None


_worker_decoder: dict = {}


def _init_redecode_worker(transform, seed: int) -> None:
    torch.set_num_threads(1)
    _worker_decoder.update(transform=transform, seed=seed)


def _decode_sub_batch(decoder: SampleDecoder, raw: list, spill_path: str | None = None) -> torch.Tensor:
    """``[n, 3, s, s]`` uint8 images of one kept sub-batch: ``(bytes, position)`` pairs, or with
    ``spill_path`` ``(offset, length, position)`` references into that file (``SpillFile``)."""
    if spill_path is None:
        return torch.stack([decoder(data, position) for data, position in raw])
    images = []
    with open(spill_path, "rb") as file:
        for offset, length, position in raw:
            file.seek(offset)
            images.append(decoder(file.read(length), position))
    return torch.stack(images)


def _redecode_sub_batch(epoch: int, raw: list, spill_path: str | None = None) -> torch.Tensor:
    decoder = SampleDecoder(_worker_decoder["transform"], _worker_decoder["seed"], epoch)
    return _decode_sub_batch(decoder, raw, spill_path)


_SPILL_NAME = re.compile(r"offload-(?P<host>.+)-rank\d+-pid(?P<pid>\d+)\.bin")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only (PermissionError: someone else's process)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale_spill_files(folder: Path) -> None:
    """Delete spill files that runs on this host left behind when they died (killed, crashed, out of
    memory), a whole step's bytes each. Only files named for this host whose process is gone: a
    shared folder's files from other hosts, and live runs' files, are left alone."""
    host = socket.gethostname()
    for path in folder.glob("offload-*.bin"):
        match = _SPILL_NAME.fullmatch(path.name)
        if match and match["host"] == host and not _process_alive(int(match["pid"])):
            try:  # the host's other ranks clean up at the same moment: whoever is first removes it
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            log.warning("removed %s (%.2f GB): a spill file left by a run that ended without cleaning up",
                        path, size / 1e9)


class SpillFile:
    """``trainer.offload_dir``: a step's kept image bytes appended to one local file (per rank)
    instead of held in host memory; the replay reads them back by (offset, length). Host memory
    then no longer grows with the batch (the page cache holds what fits and the kernel may evict
    it); the file is rewritten from the start every step and deleted at the end of the run."""

    def __init__(self, directory: str, rank: int):
        folder = Path(directory).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_spill_files(folder)
            self.path = str(folder / f"offload-{socket.gethostname()}-rank{rank}-pid{os.getpid()}.bin")
            self.file = open(self.path, "w+b")  # noqa: SIM115 - open for the run, closed by close()
        except OSError as error:
            raise ConfigError(f"trainer.offload_dir={directory!r} is not a writable directory ({error}); "
                              "give a local scratch path, or null to keep the bytes in host memory") from None
        self.offset = 0

    def keep(self, raw: list) -> list:
        """Append ``(bytes, position)`` pairs; return their ``(offset, length, position)``."""
        refs = []
        for data, position in raw:
            self.file.write(data)
            refs.append((self.offset, len(data), position))
            self.offset += len(data)
        return refs

    def flush(self) -> None:
        self.file.flush()  # into the page cache, where the re-decode workers read it

    def reset(self) -> None:
        self.file.seek(0)
        self.offset = 0

    def close(self) -> None:
        self.file.close()
        Path(self.path).unlink(missing_ok=True)


class Redecoder:
    """Re-decodes offloaded sub-batches in a pool of worker processes that lives as long as the
    run (a DataLoader per step would fork its workers again every step, seconds at 16 workers).
    At most ``2 x workers`` sub-batches are decoded ahead of the consumer, so host memory stays
    bounded however long the replay. Results come back through shared memory (torch tensors)."""

    def __init__(self, transform, seed: int, workers: int, timeout_s: float = 600.0):
        self.transform, self.seed, self.workers, self.timeout_s = transform, seed, workers, timeout_s
        self.pool = None

    def __call__(self, raw_sub_batches: list, epoch: int, spill_path: str | None = None) -> Iterator[torch.Tensor]:
        if self.workers == 0:
            decoder = SampleDecoder(self.transform, self.seed, epoch)
            for raw in raw_sub_batches:
                yield _decode_sub_batch(decoder, raw, spill_path)
            return
        self.start()
        pending, upcoming = deque(), iter(raw_sub_batches)
        for raw in itertools.islice(upcoming, 2 * self.workers):
            pending.append(self.pool.apply_async(_redecode_sub_batch, (epoch, raw, spill_path)))
        while pending:
            try:  # a pool does not notice a worker killed from outside (OOM): wait bounded
                images = pending.popleft().get(timeout=self.timeout_s)
            except multiprocessing.TimeoutError:
                raise RuntimeError(
                    f"an offload re-decode worker gave no sub-batch in {self.timeout_s:.0f} s (killed by "
                    "the out-of-memory killer? see dmesg); fewer data.num_workers or trainer.offload=false"
                ) from None
            raw = next(upcoming, None)
            if raw is not None:
                pending.append(self.pool.apply_async(_redecode_sub_batch, (epoch, raw, spill_path)))
            yield images

    def start(self) -> None:
        """Fork the worker pool (once). Forking while this process is still small keeps the fork
        fast and the children's page tables small: after phase 1 it holds every kept image's bytes."""
        if self.pool is None and self.workers > 0:
            import torch.multiprocessing as mp

            self.pool = mp.get_context("fork").Pool(self.workers, initializer=_init_redecode_worker,
                                                    initargs=(self.transform, self.seed))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None
