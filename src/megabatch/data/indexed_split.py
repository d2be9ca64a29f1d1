"""The indexed split (``data.train.split=indexed``): local shards read by random access, in an order
that is a function of the seed, the epoch and the sample's position alone.

Which sample sits at position ``p`` of an epoch (``EpochOrder``): the shards, shuffled from (seed,
epoch), are laid end to end as one sequence of the epoch's ``N`` samples; the sequence is cut into
``data.train.streams`` equal parts, read side by side (position ``i`` is sample ``i // S`` of part
``i % S``), so a batch draws from that many places of the data at once; positions are then shuffled
within windows of ``data.train.shuffle_buffer``. Rank ``r`` of ``W`` takes the positions ``p`` of its
global batch with ``p % W == r``, as the position split does; each loader worker fetches only the
samples of the sub-batches it builds (``TarIndex``: each sample's byte range in its tar, found once
per shard by a scan of the headers, cached under ``data.cache_dir``).

So the samples of every global batch, and each one's augmentation (seeded by its position), are
the same whatever the number of ranks, loader workers or the sub-batch size: a run resumed on
another number of GPUs reads exactly what the uninterrupted run would have read, and nothing is read
twice or skipped over. The shards must be files (local or mounted): a stream cannot be read at an
offset (``split=shard`` reads those).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import tarfile
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..config import ConfigError
from .position_split import PositionSplitBatches
from .samples import decode_pair
from .tars import NotPlain, sample_key, sample_starts, tar_headers, tar_members, tarfile_members
from .urls import is_remote

log = logging.getLogger(__name__)

INDEX_DIR = "tar_index"  # under data.cache_dir: one .npy of sample start offsets per shard
STAND_IN_TRIES = 16  # later places tried for a stand-in of an unusable sample


class EpochOrder:
    """Position -> (shard, sample within the shard) for one epoch (see the module's docstring)."""

    def __init__(self, sizes: list[int], seed: int, epoch: int, streams: int, window: int):
        epoch_seed = seed * 100_003 + epoch
        self.order = list(range(len(sizes)))
        random.Random(epoch_seed).shuffle(self.order)  # as the position split shuffles its shards
        lengths = np.array([sizes[shard] for shard in self.order], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # the sequence index of each shard's first sample
        self.streams = max(1, min(int(streams), int(self.starts[-1])))
        self.part = int(self.starts[-1]) // self.streams  # each stream's length; < streams samples left out
        self.window, self.epoch_seed = max(1, int(window)), epoch_seed
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.part * self.streams

    def _shuffled(self, positions: np.ndarray) -> np.ndarray:
        """Each position's place after the shuffle within its window of ``window`` positions."""
        out = np.empty_like(positions)
        for index, position in enumerate(positions.tolist()):
            window, offset = divmod(position, self.window)
            perm = self._perms.get(window)
            if perm is None:
                size = min(self.window, len(self) - window * self.window)
                perm = np.random.default_rng([self.epoch_seed, window]).permutation(size)
                self._perms[window] = perm
                if len(self._perms) > 8:
                    self._perms.popitem(last=False)
            out[index] = window * self.window + perm[offset]
        return out

    def locate(self, positions) -> list[tuple[int, int]]:
        """``(shard index into sizes, sample index within that shard)`` of each position."""
        shuffled = self._shuffled(np.asarray(positions, dtype=np.int64))
        sequence = (shuffled % self.streams) * self.part + shuffled // self.streams
        shards = np.searchsorted(self.starts, sequence, side="right") - 1
        return [(self.order[shard], int(at - self.starts[shard])) for shard, at in zip(shards, sequence, strict=True)]


class TarIndex:
    """Where each sample of a tar shard starts (the offset of its first member's header) and where
    the last one ends: ``samples[i]`` = ``{"__key__", extension: bytes, ...}`` read with one seek and
    one read. Built by one scan of the headers (no data read), kept under ``cache_dir`` keyed by
    the file's path, size and modification time; a few shards' indexes and open files are kept."""

    def __init__(self, cache_dir: str | os.PathLike | None, keep: int = 64):
        self.cache = Path(os.path.expanduser(str(cache_dir))) / INDEX_DIR if cache_dir else None
        self.keep = keep
        self._open: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()

    def read(self, url: str, sample: int) -> dict | None:
        """Sample ``sample`` of shard ``url`` as webdataset would give it, or ``None`` where the shard
        has fewer (truncated, or fewer than its listed count)."""
        offsets, fd = self._shard(url)
        if sample + 1 >= len(offsets):
            return None
        start = int(offsets[sample])
        chunk = os.pread(fd, int(offsets[sample + 1]) - start, start)  # one system call, no buffer to refill
        fields: dict = {"__url__": url}
        for name, data in tar_members(chunk):
            grouped = sample_key(name)
            if grouped is not None:
                fields.setdefault("__key__", grouped[0])
                fields[grouped[1]] = data
        return fields

    def close(self) -> None:
        for _, fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def _shard(self, url: str) -> tuple[np.ndarray, int]:
        if url in self._open:
            self._open.move_to_end(url)
            return self._open[url]
        path = Path(os.path.expanduser(url))
        offsets = self.offsets(path)
        entry = (offsets, os.open(path, os.O_RDONLY))  # kept open for the next samples, closed on eviction
        self._open[url] = entry
        if len(self._open) > self.keep:
            os.close(self._open.popitem(last=False)[1][1])
        return entry

    def offsets(self, path: Path) -> np.ndarray:
        """Shard ``path``'s sample offsets (``scan_offsets``), from the cache where the file is unchanged, else
        scanned and cached."""
        stat = path.stat()
        name = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest() + ".npy"
        if self.cache is not None and (self.cache / name).is_file():
            try:
                return np.load(self.cache / name)
            except (OSError, ValueError):
                pass  # a damaged cache entry: scanned again below
        offsets = scan_offsets(path)
        if self.cache is not None:
            self.cache.mkdir(parents=True, exist_ok=True)
            # a name no other writer has (ranks and nodes sharing the cache index the same shards at once)
            tmp = self.cache / f".{name}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as handle:
                np.save(handle, offsets)
            os.replace(tmp, self.cache / name)
        return offsets


class IndexScan:
    """The indexed split's way to count a shard's samples (``urls.shard_sizes``'s ``scan``): the one header scan
    that builds the shard's ``TarIndex`` (cached under ``cache_dir``, where the loader's workers find it and
    never scan the shard again), its count the index's. Picklable: the counting's processes run it."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.cache_dir = cache_dir

    def __call__(self, path: str) -> int:
        return len(TarIndex(self.cache_dir).offsets(Path(path))) - 1


def scan_offsets(path: Path) -> np.ndarray:
    """Each sample's start offset in the tar (its first member's header, extended headers included),
    then the end of the last one: one read of the headers, none of the data. Members of one sample
    share the name up to the first dot of the file name (webdataset's grouping); a damaged tail
    ends the index where the damage starts."""
    try:  # a plain tar's headers read by tars.tar_headers; anything else by tarfile (below)
        starts, end = sample_starts(tar_headers(path))
        return np.array([*starts, end], dtype=np.int64)
    except (NotPlain, OSError):
        pass
    members, error = tarfile_members(path, "r:")  # grouped as urls.scan_tar counts them: the index and counts agree
    starts, end = sample_starts(members)
    if error is not None:  # the sample being read when the damage came may be cut short: the index ends where it starts
        end = starts.pop() if starts else 0
        log.warning("%s: %s; indexed the %d samples before it", path, error, len(starts))
    return np.array([*starts, end], dtype=np.int64)


class IndexedBatches(PositionSplitBatches):
    """This rank's sub-batches of one epoch by random access (``data.train.split=indexed``):
    ``PositionSplitBatches``'s contract, reading only the samples this worker's sub-batches hold."""

    def __init__(self, urls: list[str], *, sizes: list[int], streams: int, cache_dir, **kwargs):
        remote = [url for url in urls if is_remote(url)]
        if remote:
            raise ConfigError(f"data.train.split=indexed reads shards by random access, and {remote[0]!r} is a "
                              "stream: copy or mount the shards locally, or use data.train.split=shard")
        super().__init__(urls, **kwargs)
        self.sizes, self.streams, self.cache_dir = sizes, streams, cache_dir

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        self.worker = worker
        self.stats.count_shards = True  # each shard's damage is met by the worker reading that sample
        order = EpochOrder(self.sizes, self.seed, self.epoch, self.streams, self.shuffle_buffer)
        index = TarIndex(self.cache_dir)
        global_batch = self.rank_batch * self.world_size
        per_batch = self.rank_batch // self.sub_batch
        broken: set[str] = set()
        try:
            for chunk in self._my_chunks(worker, num_workers):
                batch, first = divmod(chunk, per_batch)
                # this rank's samples j of the global batch: positions batch * b + rank + j * W
                rows = torch.arange(first * self.sub_batch, (first + 1) * self.sub_batch)
                positions = (batch * global_batch + self.rank + rows * self.world_size).tolist()
                pending, missing = [], []
                for position, located in zip(positions, order.locate(positions), strict=True):
                    item = self._sample(index, position, located, broken)
                    if item is None:
                        missing.append(position)
                    else:
                        pending.append(item)
                for position in missing:  # the next readable sample at this place of a later batch
                    item = self._stand_in(index, order, position, global_batch, broken)
                    if item is not None:
                        pending.append(item)
                yield self._collate(pending)
        finally:
            index.close()

    def _sample(self, index: TarIndex, position: int, located: tuple[int, int], broken: set[str]) -> tuple | None:
        """The sample at ``position``, read and decoded (``(bytes, position, image, caption)``), or
        ``None`` where it is unreadable (counted)."""
        shard, sample = located
        url = self.urls[shard]
        raw = None if url in broken else self._read(index, url, sample, broken)
        if raw is None:
            return None
        self.stats.got_sample()
        pair = decode_pair(raw, self.stats, self.decoder.decode, self.decoder.captions, position,
                           self.decoder.image_keys)
        if pair is None:
            return None
        image_bytes, image, caption = pair
        return image_bytes, position, self.decoder(image, position), caption

    def _stand_in(self, index: TarIndex, order: EpochOrder, position: int, global_batch: int,
                  broken: set[str]) -> tuple | None:
        """For an unusable sample at ``position``: the first usable one at ``position + k x
        global_batch`` (k = 1, 2, ..., wrapping within the epoch's whole batches), which is this
        rank's, of another step, and never a sample this global batch holds already; the same
        choice on any number of ranks and workers. ``None`` after ``STAND_IN_TRIES`` unusable ones."""
        span = len(order) // global_batch * global_batch
        for k in range(1, min(STAND_IN_TRIES, span // global_batch)):
            candidate = (position + k * global_batch) % span
            item = self._sample(index, candidate, order.locate([candidate])[0], broken)
            if item is not None:
                self.stats.stand_in += 1
                return item
        return None

    def _read(self, index: TarIndex, url: str, sample: int, broken: set[str]) -> dict | None:
        """One sample's fields, or ``None``: a shard that cannot be opened is counted once and its
        samples skipped; a sample missing from a shorter (truncated) or damaged one is skipped,
        the shard counted once."""
        try:
            raw = index.read(url, sample)
        except OSError as error:  # the file cannot be read at all
            broken.add(url)
            raw, reason = None, error
        except (tarfile.TarError, EOFError) as error:  # this sample's bytes are damaged
            raw, reason = None, error
        else:
            reason = f"no sample {sample} (fewer samples than its listed count: truncated?)"
        if raw is None and url not in self.stats.broken_urls:
            self.stats.broken_urls.add(url)
            self.stats.broken_shard += 1
            self.stats.warn("broken_shard", "shard %s: %s; its missing samples are skipped", url, reason)
        return raw
