"""Data offload (``trainer.offload``): the one owner of what a GradCache step keeps between its
first encoding (phase 1) and its replay (phase 3) instead of the input tensors.

Phase 1 hands each sub-batch's encoded image bytes and stream positions to ``Offload.keep``; the
replay asks ``Offload.replay_images`` for the images again and gets them decoded anew, with the same
per-sample augmentation (seeded by seed, epoch and position: ``samples.SampleDecoder``), by a pool
of worker processes that lives as long as the run (``Redecoder``). The bytes are held in host memory, or with
``trainer.offload_dir`` appended to one local spill file per rank and read back by offset, so host
memory stays flat however large the batch. The replay is the last to read a step's bytes: once it has them
all (or stops), the next step's are written over them. ``close`` stops the workers and deletes the spill file.
Spill files that killed runs left behind on this host are removed when the next run opens its own.

    offload = Offload(transform, seed, workers=16, spill_dir="/local/scratch", rank=0)
    kept = [offload.keep(sub.raw) for sub in sub_batches]     # phase 1 (EncodedImages)
    for images in offload.replay_images(kept, epoch): ...     # phase 3, same order
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import ConfigError
from ..runtime.signals import ignore_stop_signals, process_alive, stop_signals_blocked
from .gpu_decode import DecodePool, GpuDecoder, decode_ahead, to_device
from .samples import EncodedImages, JpegBatch, SampleDecoder

log = logging.getLogger(__name__)


class Offload:
    """Keeps a step's encoded image bytes (in host memory, or in a spill file under ``spill_dir``)
    and re-decodes them for the replay in ``workers`` persistent processes (0: in this process).
    The pool is forked at construction, while this process is still small (after phase 1 it holds
    every kept image's bytes, and forking then is slow and copies large page tables)."""

    def __init__(self, transform: Callable, seed: int, workers: int, spill_dir: str | None = None,
                 rank: int = 0, gpu: GpuDecoder | None = None):
        self.spill = SpillFile(spill_dir, rank) if spill_dir else None
        self.transform, self.seed, self.gpu = transform, seed, gpu
        # data.decode=gpu: the replay decodes on the GPU too; no worker pool is needed
        self.redecoder = Redecoder(transform, seed, 0 if gpu is not None else workers)
        self.redecoder.start()

    @property
    def spill_path(self) -> str | None:
        return self.spill.path if self.spill is not None else None

    def keep(self, raw: EncodedImages, boxes: torch.Tensor | None = None):
        """What phase 1 holds on to for one sub-batch: its encoded images and positions, in ordinary memory (a
        loader worker's tensor lives in shared memory and holds a file descriptor as long as it lives, and a
        step keeps thousands), or with a spill file where they are there (``Spilled``); decoding on the GPU,
        with the crop ``boxes`` of an all-JPEG sub-batch (``SubBatch.boxes``; ``None``: drawn again)."""
        if self.spill is not None:
            kept = self.spill.keep(raw)
        elif raw.blob.is_shared():
            kept = EncodedImages(raw.blob.clone(), raw.offsets.clone(), raw.positions.clone())
        else:
            kept = raw
        return (kept, boxes) if self.gpu is not None else kept

    def replay_images(self, kept: list, epoch: int) -> Iterator[torch.Tensor]:
        """The uint8 images ``[n, 3, s, s]`` of each kept sub-batch again, in order, decoded with the same
        per-sample augmentation as the first time (on the GPU: its decoding starts now; by the worker pool: at the
        first request). The replay is the last to read this step's bytes: the next step's ``keep`` writes the spill
        file from its start again."""
        spill_path = None
        if self.spill is not None:
            self.spill.reset()  # every byte into the page cache, where the re-decoding reads it; then rewound
            spill_path = self.spill.path
        if self.gpu is not None:
            return self._replay_on_gpu(kept, epoch, spill_path)
        return self.redecoder(kept, epoch, spill_path)

    def _replay_on_gpu(self, kept: list, epoch: int, spill_path: str | None) -> Iterator[torch.Tensor]:
        """``data.decode=gpu``: a thread reads each kept sub-batch's bytes back, draws the same crop
        boxes from the same seeds and has the GPU decode them (``gpu_decode.decode_ahead``); the
        images come out on the device."""
        decoder, gpu = SampleDecoder(self.transform, self.seed, epoch, gpu=True), self.gpu

        def again(kept: tuple):
            raw, boxes = kept
            encoded = _read_back(raw, spill_path)
            if boxes is not None:  # all JPEGs: the boxes phase 1 cut, the bytes it read
                return gpu(decoder.jpeg_batch(encoded, boxes))
            images = decoder.again(encoded)  # rows the CPU decodes: drawn and decoded again
            return gpu(images) if isinstance(images, JpegBatch) else to_device(images, gpu.device)

        return decode_ahead(iter(kept), again, gpu.pool, priority=DecodePool.REPLAY)

    def close(self) -> None:
        self.redecoder.close()
        if self.spill is not None:
            self.spill.close()
            self.spill = None


_worker_decoder: dict = {}


def _init_redecode_worker(transform, seed: int) -> None:
    ignore_stop_signals()  # the main process stops the run (train/trainer/stops.py); the pool ends by its own message
    torch.set_num_threads(1)
    _worker_decoder.update(transform=transform, seed=seed)


def _decode_sub_batch(decoder: SampleDecoder, raw: EncodedImages | Spilled,
                      spill_path: str | None = None) -> torch.Tensor:
    """``[n, 3, s, s]`` uint8 images of one kept sub-batch (``Spilled``: in the file ``spill_path``; a NaFlex
    tower's: its packed patches)."""
    return decoder.again(_read_back(raw, spill_path))


def _read_back(raw: EncodedImages | Spilled, spill_path: str | None) -> EncodedImages:
    """A kept sub-batch's encoded images (read from the spill file, in one read, when kept there)."""
    if not isinstance(raw, Spilled):
        return raw
    with open(spill_path, "rb") as file:
        file.seek(raw.offset)
        data = bytearray(file.read(raw.length))
    if len(data) != raw.length:
        raise RuntimeError(f"the offload spill file {spill_path} ends {raw.length - len(data)} bytes short of "
                           "what this step kept there (was it truncated or deleted during the step?)")
    blob = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return EncodedImages(blob, raw.offsets, raw.positions)


def _redecode_sub_batch(epoch: int, raw: EncodedImages | Spilled, spill_path: str | None = None) -> torch.Tensor:
    decoder = SampleDecoder(_worker_decoder["transform"], _worker_decoder["seed"], epoch)
    return _decode_sub_batch(decoder, raw, spill_path)


_SPILL_NAME = re.compile(r"offload-(?P<host>.+)-rank\d+-pid(?P<pid>\d+)\.bin")


def remove_stale_spill_files(folder: Path) -> None:
    """Delete spill files that runs on this host left behind when they died (killed, crashed, out of
    memory), a whole step's bytes each. Only files named for this host whose process is gone: a
    shared folder's files from other hosts, and live runs' files, are left alone."""
    host = socket.gethostname()
    for path in folder.glob("offload-*.bin"):
        match = _SPILL_NAME.fullmatch(path.name)
        if match and match["host"] == host and not process_alive(int(match["pid"])):
            try:  # the host's other ranks clean up at the same moment: whoever is first removes it
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            log.warning("removed %s (%.2f GB): a spill file left by a run that ended without cleaning up",
                        path, size / 1e9)


class Spilled(NamedTuple):
    """Where a kept sub-batch's ``EncodedImages`` are in the spill file: ``length`` bytes at
    ``offset``, with the rows' ``offsets`` within them and their ``positions``."""

    offset: int
    length: int
    offsets: torch.Tensor
    positions: torch.Tensor


class SpillFile:
    """``trainer.offload_dir``: a step's kept image bytes appended to one local file (per rank)
    instead of held in host memory; the replay reads them back by (offset, length). Host memory
    then no longer grows with the batch (the page cache holds what fits and the kernel may evict
    it); the file is rewritten from the start every step and deleted at the end of the run.

    A thread writes: ``keep`` hands it the bytes and returns at once, so phase 1 goes on encoding
    while they reach the page cache (a 1M step writes ~33 GB, and past the kernel's dirty-page limit
    each write waits for the disk). At most ``queue_bytes`` wait to be written (``keep`` waits
    beyond that); ``flush`` waits for all of them, and a write that failed (disk full) is raised
    by the next ``keep`` or ``flush``."""

    def __init__(self, directory: str, rank: int, queue_bytes: int = 512 * 2**20):
        folder = Path(directory).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_spill_files(folder)
            self.path = str(folder / f"offload-{socket.gethostname()}-rank{rank}-pid{os.getpid()}.bin")
            self.file = open(self.path, "w+b")  # noqa: SIM115 - open for the run, closed by close()
        except OSError as error:
            raise ConfigError(f"trainer.offload_dir={directory!r} is not a writable directory ({error}); "
                              "give a local scratch path, or null to keep the bytes in host memory") from None
        self.offset, self.queue_bytes = 0, queue_bytes
        self._pending = deque()  # (offset, bytes) not yet written, oldest first
        self._pending_bytes, self._error = 0, None
        self._changed = threading.Condition()
        self._writer: threading.Thread | None = None  # started by the first keep: after Offload forks its pool

    def keep(self, raw: EncodedImages) -> Spilled:
        """Queue a sub-batch's encoded images for writing (one write); return where they will be."""
        kept = Spilled(self.offset, raw.nbytes(), raw.offsets.clone(), raw.positions.clone())  # not shared memory
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_pending, name="megabatch-spill-writer", daemon=True)
            self._writer.start()
        with self._changed:
            self._raise_error()
            while self._pending_bytes and self._pending_bytes + kept.length > self.queue_bytes:
                self._changed.wait()
                self._raise_error()
            self._pending.append((kept.offset, raw.blob))
            self._pending_bytes += kept.length
            self._changed.notify_all()
        self.offset += kept.length
        return kept

    def flush(self) -> None:
        """Wait until every kept byte is in the file (the replay reads it by path)."""
        with self._changed:
            while self._pending and self._error is None:
                self._changed.wait()
            self._raise_error()

    def reset(self) -> None:
        self.flush()
        self.offset = 0

    def close(self) -> None:
        if self._writer is not None:
            with self._changed:
                self._pending.append(None)  # the writer's end, after what is queued
                self._changed.notify_all()
            self._writer.join(timeout=60)
        self.file.close()
        Path(self.path).unlink(missing_ok=True)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the offload spill file {self.path} could not be written ({self._error}); free "
                               "space there, or set trainer.offload_dir to another local folder") from self._error

    def _write_pending(self) -> None:
        while True:
            with self._changed:
                while not self._pending:
                    self._changed.wait()
                item = self._pending[0]
            if item is None:
                return
            at, blob = item
            try:
                view = blob.numpy().data
                while self._error is None and len(view):  # os.pwrite may write less than asked
                    written = os.pwrite(self.file.fileno(), view, at)
                    view, at = view[written:], at + written
            except OSError as error:
                self._error = error
            with self._changed:
                self._pending.popleft()
                self._pending_bytes -= blob.numel()
                self._changed.notify_all()


class Redecoder:
    """Re-decodes offloaded sub-batches in a pool of worker processes that lives as long as the
    run (a DataLoader per step would fork its workers again every step, seconds at 16 workers).
    At most ``2 x workers`` sub-batches are decoded ahead of the consumer, so host memory stays
    bounded however long the replay. Results come back through shared memory (torch tensors).

    The pool is ``concurrent.futures.ProcessPoolExecutor``: a worker that dies (the out-of-memory
    killer) fails the waiting replay at once (``BrokenProcessPool``) instead of leaving it waiting,
    and the pool ends by a message to each worker, not by a signal, so the workers can ignore every
    stop signal from their first instruction on (forked with them blocked) and closing never
    depends on whether a signal found a worker inside a queue's lock."""

    def __init__(self, transform, seed: int, workers: int, timeout_s: float = 600.0):
        self.transform, self.seed, self.workers, self.timeout_s = transform, seed, workers, timeout_s
        self.pool: ProcessPoolExecutor | None = None

    def __call__(self, raw_sub_batches: list, epoch: int, spill_path: str | None = None) -> Iterator[torch.Tensor]:
        if self.workers == 0:
            decoder = SampleDecoder(self.transform, self.seed, epoch)
            for raw in raw_sub_batches:
                yield _decode_sub_batch(decoder, raw, spill_path)
            return
        if self.pool is None:
            self.start()
        pending, upcoming = deque(), iter(raw_sub_batches)
        try:
            for raw in itertools.islice(upcoming, 2 * self.workers):
                pending.append(self.pool.submit(_redecode_sub_batch, epoch, raw, spill_path))
            while pending:
                try:
                    images = pending.popleft().result(timeout=self.timeout_s)
                except (BrokenProcessPool, TimeoutError) as error:
                    why = "died" if isinstance(error, BrokenProcessPool) else f"gave nothing for {self.timeout_s:.0f} s"
                    raise RuntimeError(
                        f"an offload re-decode worker gave no sub-batch: it {why} (killed by the out-of-memory "
                        "killer? see dmesg); fewer data.num_workers or trainer.offload=false") from None
                raw = next(upcoming, None)
                if raw is not None:
                    pending.append(self.pool.submit(_redecode_sub_batch, epoch, raw, spill_path))
                yield images
        finally:  # a replay cut short (an error in the step) leaves no work queued for the next one
            for future in pending:
                future.cancel()

    def start(self) -> None:
        """Fork the worker pool (once; the first task forks every worker). Forking while this process
        is still small keeps the fork fast and the children's page tables small: after phase 1 it
        holds every kept image's bytes."""
        if self.pool is None and self.workers > 0:
            import torch.multiprocessing as mp

            with stop_signals_blocked():
                self.pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("fork"),
                                                initializer=_init_redecode_worker,
                                                initargs=(self.transform, self.seed))
                self.pool.submit(os.getpid).result()

    def close(self) -> None:
        """Stop the workers: queued sub-batches are dropped, each worker finishes the one it decodes
        and exits."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
