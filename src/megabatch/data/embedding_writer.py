"""Copies of shards with one ``.npy`` member added to each sample, computed on the GPU from its image (and
caption): stored image features (``scripts/make_shards.py image-features``) and stored teacher embeddings
(``scripts/make_shards.py teacher``). Written at the GPU's speed:

- loader workers (``workers``) read whole shards, decode each usable sample's image and cut it to the model's
  input (the shorter side resized to ``size``, the centre cropped: open_clip's evaluation preprocessing), and
  tokenise its caption, in batches of ``batch`` rows that run across a worker's shards;
- the main process hands each batch to ``encode`` (a compiled forward on the GPU: its batch is always
  ``batch`` rows, the last one padded), queuing the next batch before it reads the last one's results;
- a pool of writer processes copies each finished shard with its members added, under a temporary name renamed
  when whole: a shard already in the output folder is skipped, so an interrupted run resumes.

A sample without an image (or a caption, where one is read), or whose image does not decode, is copied without the
member: a run reading the copies skips and counts it. A shard that cannot be read to its end is copied byte for byte,
without the member, so that the copies keep the sources' names and counts and a run meets its damage as the source's.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import tarfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm

from .samples import IMAGE_KEYS, decode_rgb
from .tars import tar_records

log = logging.getLogger(__name__)


def centre_crop(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A uint8 ``[3, h, w]`` image as the model's ``[3, *size]`` input: the shorter side resized to the size
    (bicubic, antialiased), then the centre cropped (open_clip's evaluation preprocessing, on uint8); an image of
    the size already is taken as it is."""
    from torchvision.transforms.v2 import functional as TF

    if tuple(image.shape[-2:]) == tuple(size):
        return image
    resized = TF.resize(image, min(size), interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    return TF.center_crop(resized, list(size))


def read_samples(path: Path | str) -> dict[str, dict[str, bytes]]:
    """A tar shard's samples, ``{key: {extension: bytes}}`` in the tar's order (raises ``tarfile.ReadError`` on a
    damaged one)."""
    samples: dict[str, dict[str, bytes]] = {}
    with open(path, "rb") as file:
        for name, data in tar_records(file.read):
            key, _, ext = name.partition(".")
            samples.setdefault(key, {})[ext] = data
    return samples


@dataclass
class Rows:
    """One batch of rows from a loader worker: ``images [n, 3, *size]`` uint8, each row's ``(shard, key)``,
    its caption's token ids per tokenizer (``[n, ctx]`` each), and the shards this worker has read whole since its
    last batch, with how many rows each gave (``(shard, rows)``; their rows are in this batch or earlier ones)."""

    images: torch.Tensor | None
    keys: list[tuple[int, str]]
    tokens: list[torch.Tensor] = field(default_factory=list)
    finished: list[tuple[int, int]] = field(default_factory=list)
    unusable: int = 0

    def pin_memory(self) -> Rows:
        """The DataLoader's pin thread calls this: the images and token ids page-locked, so that their copy to the
        GPU is queued behind the forward already running instead of waiting for it (a pageable copy waits for the
        kernels queued before it: the next batch would not be launched until the last one ended)."""
        return Rows(None if self.images is None else self.images.pin_memory(), self.keys,
                    [ids.pin_memory() for ids in self.tokens], self.finished, self.unusable)


class ShardRows(IterableDataset):
    """``Rows`` of the shards ``sources`` (worker ``w`` of ``n`` reads ``sources[w::n]``), ``batch`` at a time."""

    def __init__(self, sources: Sequence[Path], size: tuple[int, int], batch: int, caption_key: str | None,
                 tokenizers: Sequence[Callable] = ()):
        self.sources, self.size, self.batch = list(sources), tuple(size), batch
        self.caption_key, self.tokenizers = caption_key, list(tokenizers)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        images, keys, captions, finished, unusable = [], [], [], [], 0
        for index in range(worker, len(self.sources), workers):
            try:
                samples = read_samples(self.sources[index])
            except (OSError, tarfile.TarError) as error:
                log.warning("%s: unreadable (%s): copied as it is, without %s (a run reading the copies skips and "
                            "counts its damage as it would the source's)", self.sources[index], error,
                            "the added member")
                samples = None
            rows = 0
            for key, sample in (samples or {}).items():
                data = next((sample[e] for e in IMAGE_KEYS if e in sample), None)
                if data is None or (self.caption_key is not None and self.caption_key not in sample):
                    unusable += 1
                    continue
                try:
                    image = centre_crop(decode_rgb(data), self.size)
                except Exception:  # noqa: BLE001 - an undecodable image: the sample is copied without the member
                    unusable += 1
                    continue
                images.append(image)
                keys.append((index, key))
                if self.caption_key is not None:
                    captions.append(sample[self.caption_key].decode("utf-8", "replace").strip())
                rows += 1
                if len(images) == self.batch:  # a whole batch: on its way while the shard's rest decodes
                    yield self._rows(images, keys, captions, finished, unusable)
                    images, keys, captions, finished, unusable = [], [], [], [], 0
            finished.append((index, -1 if samples is None else rows))
            while len(images) >= self.batch:
                yield self._rows(images[:self.batch], keys[:self.batch], captions[:self.batch], finished, unusable)
                images, keys, captions = images[self.batch:], keys[self.batch:], captions[self.batch:]
                finished, unusable = [], 0
        if images or finished:
            yield self._rows(images, keys, captions, finished, unusable)

    def _rows(self, images, keys, captions, finished, unusable) -> Rows:
        tokens = [tokenize(captions) for tokenize in self.tokenizers] if captions else []
        return Rows(torch.stack(images) if images else None, list(keys), tokens, list(finished), unusable)


def write_copy(source: str, target: str, member: str, keys: list[str], values: np.ndarray) -> int:
    """``source`` copied to ``target`` with member ``<key>.<member>`` (``values[i]`` as ``.npy``) added after each
    ``keys[i]`` sample's own (an older one of that name replaced), written under a temporary name renamed when
    whole. Returns the samples given the member. Runs in a writer process."""
    from .teacher_store import encode_embeddings

    added = dict(zip(keys, values, strict=True))
    samples = read_samples(source)
    partial = target + ".partial"
    with tarfile.open(partial, "w", format=tarfile.GNU_FORMAT) as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))

        for key, sample in samples.items():
            for ext, data in sample.items():
                if ext != member:
                    add(f"{key}.{ext}", data)
            if key in added:
                add(f"{key}.{member}", encode_embeddings(added[key]))
    os.replace(partial, target)
    return len(added)


def copy_as_is(source: str, target: str) -> int:
    """``source`` copied to ``target`` byte for byte, under a temporary name renamed when whole (a damaged shard: the
    copies keep the sources' names and counts). Returns 0: no sample given the member."""
    import shutil

    partial = target + ".partial"
    shutil.copyfile(source, partial)
    os.replace(partial, target)
    return 0


def write_embedded_shards(sources: Sequence[Path], out: Path, member: str,
                          encode: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor], *,
                          size: tuple[int, int], device: torch.device, batch: int = 512, workers: int = 8,
                          caption_key: str | None = None, tokenizers: Sequence[Callable] = (), dtype=np.float16,
                          writers: int | None = None, show_progress: bool = True,
                          desc: str = "embeddings") -> list[Path]:
    """Copies of ``sources`` in ``out`` with member ``member`` added to each usable sample: ``encode(images,
    tokens)`` of its image (uint8 ``[batch, 3, *size]`` on ``device``) and caption (``tokens``: the token ids of
    each of ``tokenizers``, on the host; with ``caption_key`` only), a ``[batch, ...]`` tensor on the device, stored
    as ``dtype``, by ``writers`` processes (default: a quarter of the cores, 4 to 8). A source whose copy is in
    ``out`` already is skipped. Returns the copies written."""
    remote = [str(source) for source in sources if not Path(source).is_file()]
    if remote:
        from ..config import ConfigError

        raise ConfigError(f"{len(remote)} of the shards are not local files (e.g. {remote[0]}): embeddings are written "
                          "from local or mounted shards, copied beside them; fetch the shards first")
    out.mkdir(parents=True, exist_ok=True)
    todo = [Path(source) for source in sources if not (out / Path(source).name).exists()]
    skipped = len(sources) - len(todo)
    progress = tqdm(total=len(sources), initial=skipped, desc=desc, unit="shard", disable=not show_progress,
                    dynamic_ncols=True)
    if not todo:
        progress.close()
        return []
    loader = DataLoader(ShardRows(todo, size, batch, caption_key, tokenizers), batch_size=None,
                        num_workers=min(workers, len(todo)), pin_memory=device.type == "cuda",
                        prefetch_factor=4 if workers > 0 else None, persistent_workers=False)
    totals: dict[int, int] = {}
    got: dict[int, list[tuple[str, np.ndarray]]] = {}
    written: list[Path] = []
    futures: list[tuple[int, Future]] = []
    writers = writers if writers is not None else max(4, min(8, (os.cpu_count() or 4) // 4))
    pool = ProcessPoolExecutor(max_workers=max(1, writers), mp_context=multiprocessing.get_context("forkserver"))
    unusable = 0

    def finish(index: int) -> None:
        rows = got.get(index, [])
        if index not in totals or len(rows) < totals[index]:
            return
        got.pop(index, None)
        if totals.pop(index) < 0:  # unreadable: copied byte for byte (a run's loader counts the damage as the source's)
            futures.append((index, pool.submit(copy_as_is, str(todo[index]), str(out / todo[index].name))))
            collect(block=False)
            return
        keys = [key for key, _ in rows]
        values = np.stack([value for _, value in rows]) if rows else np.zeros((0,), dtype)
        futures.append((index, pool.submit(write_copy, str(todo[index]), str(out / todo[index].name), member, keys,
                                           values)))
        collect(block=False)

    def collect(block: bool) -> None:
        while futures and (block or futures[0][1].done()):
            index, future = futures.pop(0)
            future.result()  # a writer's error surfaces here
            written.append(out / todo[index].name)
            progress.update(1)

    def take(pending) -> None:
        rows, values, ready = pending
        ready.synchronize()
        array = values.numpy().astype(dtype)
        for (index, key), value in zip(rows.keys, array, strict=False):
            got.setdefault(index, []).append((key, value))
        for index in {index for index, _ in rows.keys}:
            finish(index)

    pending = None
    try:
        for rows in loader:
            unusable += rows.unusable
            launched = None
            if rows.images is not None:
                images, tokens = rows.images.to(device, non_blocking=True), rows.tokens
                short = batch - len(images)
                if short > 0:  # the compiled forward sees one shape: a short batch padded
                    images = torch.cat([images, images.new_zeros((short, *images.shape[1:]))])
                    tokens = [torch.cat([ids, ids.new_zeros((short, *ids.shape[1:]))]) for ids in tokens]
                with torch.no_grad():
                    values = encode(images, tokens)[:len(rows.keys)]
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=device.type == "cuda")
                host.copy_(values, non_blocking=True)
                ready = torch.cuda.Event() if device.type == "cuda" else None
                if ready is not None:
                    ready.record()
                launched = (rows, host, ready or _Done())
            if pending is not None:  # the previous batch's results, while this one runs
                take(pending)
            pending = launched
            for index, total in rows.finished:
                totals[index] = total
                finish(index)
        if pending is not None:
            take(pending)
        for index in list(totals):
            finish(index)
        collect(block=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.close()
    if unusable:
        log.warning("%d sample(s) without a usable image%s: copied without %s", unusable,
                    " or caption" if caption_key else "", member)
    return written


class _Done:
    """An event that has happened (the CPU's results are ready once computed)."""

    def synchronize(self) -> None:
        pass
