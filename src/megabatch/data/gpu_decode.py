"""JPEG decoding on the GPU (``data.decode=gpu``): nvJPEG through ``torchvision.io.decode_jpeg``.

With ``data.decode=cpu`` every loader worker decodes, crops and resizes its samples: at 1M samples
a step the host cores, not the GPU, set the pace (16 cores decode ~4,500 samples/s; a ViT-B/32's
graph-free forward takes ~11,000 on an H100), and data offload decodes every image twice. With
``gpu`` the workers only read tar members, keep the bytes and read each JPEG's header; the crop box
is still drawn on the CPU from the sample's seed (``SampleDecoder.box``, the CPU path's own
function), so the GPU cuts the same crop. ``GpuDecoder`` decodes a sub-batch's JPEGs in one batched
nvJPEG call, cuts each box and resizes it with the model's interpolation (antialiased, as the CPU
path does), and rounds to uint8: ``[n, 3, s, s]`` on the device, as the CPU path's tensors are once
copied there. ``decode_ahead`` runs it in a thread on its own CUDA stream, a few sub-batches ahead
of the step, for phase 1 and for the offload replay alike; the replay's sub-batches first (``DecodePool``).

Pixels: decoding the same bytes twice on the GPU gives the same tensor bit for bit (the replay
relies on it). Against the CPU path (libjpeg-turbo) they are equal for 4:4:4 JPEGs; for chroma-
subsampled ones (4:2:0, most photos) nvJPEG upsamples the chroma differently, so pixels differ by
1.6 on average (up to ~20 at sharp colour edges), measured on an H100 (docs/bench/README.md).

Rows the GPU does not decode (PNG, WebP, CMYK JPEGs, ...) come decoded by the workers as before
(``probe_jpeg``); a JPEG nvJPEG refuses is decoded on the CPU instead, and one nothing can decode
(its header read well, its body is corrupt) becomes a black image, counted as ``corrupt_image``
and logged: the sample is already in the sub-batch, and sub-batches keep their size.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from ..config import ConfigError
from .samples import JpegBatch, SubBatch, decode_rgb

log = logging.getLogger(__name__)
def resized_crops(images: list[torch.Tensor], boxes: torch.Tensor, size: tuple[int, int],
                  interpolation: str, chunk_bytes: float = 512e6) -> torch.Tensor:
    """Each uint8 image ``[3, h_i, w_i]`` (on the GPU) cut to its box (``boxes [n, 4]`` on the CPU:
    top, left, height, width) and resized to ``size`` as ``F.interpolate(..., antialias=True)``
    resizes (bicubic or bilinear; nearest without antialiasing), then clamped and rounded to uint8
    like the CPU path: ``[n, 3, s, s]``. Batched, whatever the crops: each crop-and-resize is two
    matrix products with per-sample resampling matrices (``resample_matrices``: the crop offset is
    their zero columns), in float64 (exact, and free of the TF32 setting), over images of one size
    at a time: a sub-batch costs a few dozen GPU calls, not several per image. Nothing here waits
    for the GPU: the boxes and the row order travel in page-locked memory (a pageable copy would
    wait for every kernel queued before it)."""
    device, n = images[0].device if images else boxes.device, len(images)
    by_shape: dict[tuple, list[int]] = {}
    for row, image in enumerate(images):
        by_shape.setdefault(tuple(image.shape), []).append(row)
    order = [row for rows in by_shape.values() for row in rows]  # rows grouped by image size
    on_device = to_device(boxes[order] if order != list(range(n)) else boxes, device)
    out = torch.empty((n, 3, *size), dtype=torch.uint8, device=device)
    done = 0
    for (_, height, width), rows in by_shape.items():
        step = max(1, int(chunk_bytes // (3 * height * width * 8)))  # float64 images per chunk
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            pixels = torch.stack([images[row] for row in chunk]).double()  # [m, 3, H, W]
            crop = on_device[done:done + len(chunk)]
            along_h = resample_matrices(crop[:, 0], crop[:, 2], height, size[0], interpolation)  # [m, s, H]
            along_w = resample_matrices(crop[:, 1], crop[:, 3], width, size[1], interpolation)   # [m, s, W]
            resized = along_h.unsqueeze(1) @ pixels @ along_w.transpose(1, 2).unsqueeze(1)
            out[done:done + len(chunk)] = resized.clamp_(0, 255).round_()
            done += len(chunk)
    return in_row_order(out, order)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor copied to ``device`` without waiting for the GPU (through page-locked memory)."""
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def in_row_order(out: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``out``'s rows, which are rows ``order`` of a batch, put back in the batch's order."""
    if order == list(range(len(order))):
        return out
    inverse = torch.empty(len(order), dtype=torch.int64)
    inverse[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order))
    return out[to_device(inverse, out.device)]


def resample_matrices(start: torch.Tensor, length: torch.Tensor, full: int, out: int,
                      interpolation: str) -> torch.Tensor:
    """``[m, out, full]``: row ``i`` of sample ``k`` holds the weights that output pixel ``i`` gives
    the input pixels ``start[k] .. start[k] + length[k]`` along one axis (zero elsewhere): PyTorch's
    antialiased resampling (``aten/src/ATen/native/cpu/UpSampleKernel.cpp``, ``align_corners=False``):
    the filter widened by the scale when shrinking, cut to the window ``[xmin, xmax)``, normalised."""
    start, length = start.double()[:, None, None], length.double()[:, None, None]
    scale = length / out
    i = torch.arange(out, device=start.device, dtype=torch.float64)[None, :, None]
    j = torch.arange(full, device=start.device, dtype=torch.float64)[None, None, :] - start  # within the crop
    if interpolation == "nearest":  # F.interpolate's nearest: source floor(i * scale)
        source = torch.minimum(torch.floor(i * scale), length - 1)
        return (j == source).double()
    half = 2.0 if interpolation == "bicubic" else 1.0  # the filter's support: 2 (bicubic), 1 (bilinear)
    shrinking = scale >= 1.0
    support = torch.where(shrinking, half * scale, torch.full_like(scale, half))
    invscale = torch.where(shrinking, 1.0 / scale, torch.ones_like(scale))
    center = scale * (i + 0.5)
    xmin = torch.clamp(torch.trunc(center - support + 0.5), min=0.0)
    xmax = torch.minimum(torch.trunc(center + support + 0.5), length)
    x = ((j - center + 0.5) * invscale).abs()
    if interpolation == "bicubic":  # Keys' cubic with a = -0.5, as PIL and PyTorch's antialiasing
        a = -0.5
        weights = torch.where(x < 1.0, ((a + 2) * x - (a + 3)) * x * x + 1,
                              torch.where(x < 2.0, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, torch.zeros_like(x)))
    else:
        weights = torch.clamp(1.0 - x, min=0.0)
    weights = torch.where((j >= xmin) & (j < xmax), weights, torch.zeros_like(weights))
    total = weights.sum(-1, keepdim=True)
    return torch.where(total != 0, weights / total, weights)



def check_gpu_decode(device: torch.device) -> None:
    """Raise a one-line error when ``data.decode=gpu`` cannot work on ``device``."""
    if device.type != "cuda":
        raise ConfigError(f"data.decode=gpu decodes JPEGs with nvJPEG on a CUDA device, and this run's device is "
                          f"{device.type} (trainer.device); use data.decode=cpu, or auto (gpu on CUDA, cpu otherwise)")
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"data.decode=gpu needs torchvision.io.decode_jpeg ({error}); use data.decode=cpu") from None


def resolve_decode(decode: str, device: torch.device) -> str:
    """``data.decode``: ``auto`` is ``gpu`` on a CUDA device, ``cpu`` otherwise; ``gpu`` is checked."""
    if decode == "auto":
        return "gpu" if device.type == "cuda" else "cpu"
    if decode == "gpu":
        check_gpu_decode(device)
    return decode


class GpuDecoder:
    """Turns a ``JpegBatch`` into uint8 images ``[n, 3, s, s]`` on ``device``, on the current CUDA
    stream. ``corrupt_image``: rows nothing could decode (black images), counted for the logs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.corrupt_image = 0
        self._pool: DecodePool | None = None

    @property
    def pool(self) -> DecodePool:
        """The decoding threads (``DecodePool``), started on first use."""
        if self._pool is None:
            self._pool = DecodePool(self.device)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __call__(self, batch: JpegBatch) -> torch.Tensor:
        n, cpu_rows = len(batch), set(batch.cpu_rows)
        gpu_rows = [row for row in range(n) if row not in cpu_rows]
        parts = []
        if gpu_rows:
            encoded = batch.data.views()
            images = self._decode([encoded[row] for row in gpu_rows])
            boxes = batch.boxes if not cpu_rows else batch.boxes[gpu_rows]
            if any(image is None for image in images):
                boxes = boxes.clone()
                for index, image in enumerate(images):
                    if image is None:  # nothing decodes it: a black image, counted in _decode
                        images[index] = torch.zeros((3, 1, 1), dtype=torch.uint8, device=self.device)
                        boxes[index] = torch.tensor([0, 0, 1, 1])
            parts.append(resized_crops(images, boxes, batch.size, batch.interpolation))
        if cpu_rows:
            parts.append(to_device(batch.decoded, self.device))
        if not cpu_rows or not gpu_rows:
            return parts[0]
        return in_row_order(torch.cat(parts), gpu_rows + list(batch.cpu_rows))

    def sub_batch(self, sub: SubBatch) -> SubBatch:
        """``sub`` with its images on the device: its JPEGs decoded there. An all-JPEG sub-batch keeps
        its crop boxes (``SubBatch.boxes``): the offload replay cuts them again without redrawing."""
        if isinstance(sub.images, JpegBatch):
            boxes = None if sub.images.cpu_rows else sub.images.boxes
            return sub._replace(images=self(sub.images), boxes=boxes)
        return sub._replace(images=sub.images.to(self.device, non_blocking=True))

    def _decode(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """nvJPEG on the whole list of encoded images (uint8 CPU tensors) at once; if it refuses the
        list, row by row, a row it refuses on the CPU, and a row nothing decodes as ``None`` (counted)."""
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pass
        images = []
        for item in encoded:
            try:
                images.append(decode_jpeg([item], mode=ImageReadMode.RGB, device=self.device)[0])
                continue
            except RuntimeError:
                pass
            try:
                images.append(decode_rgb(item.numpy().tobytes()).to(self.device))
            except Exception as error:  # noqa: BLE001 - any decoder failure means a corrupt image
                self.corrupt_image += 1
                log.warning("an image whose JPEG header reads well does not decode (%s): a black image "
                            "takes its place in the sub-batch (%d so far)", error, self.corrupt_image)
                images.append(None)
        return images


class DecodePool:
    """The GPU decoding threads of a run (each on its own CUDA stream), shared by phase 1's look-ahead
    and the offload replay. Tasks run by ``priority`` (lower first), then in submission order: the
    replay's go first, since the step is waiting for them, and the next phase 1's look-ahead takes
    what decoding capacity the replay leaves (nvJPEG decodes one call at a time, so the two would
    otherwise take turns, and the replay would wait for images the next step does not need yet).
    A task's result comes with an event recorded on its thread's stream after its work."""

    REPLAY, LOOK_AHEAD = 0, 1

    def __init__(self, device: torch.device, threads: int = 2):
        self.device = device
        self._tasks: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"megabatch-gpu-decode_{index}", daemon=True)
                         for index in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, work: Callable, item, priority: int) -> Future:
        """A future of ``(work(item), event)``."""
        future: Future = Future()
        self._tasks.put((priority, next(self._order), future, work, item))
        return future

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        while True:
            _, _, future, work, item = self._tasks.get()
            if future is None:  # close()
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if stream is None:
                    future.set_result((work(item), None))
                    continue
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    result = work(item)
                    event = torch.cuda.Event()
                    event.record(stream)
                future.set_result((result, event))
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put((-1, next(self._order), None, None, None))
        for thread in self._threads:
            thread.join(timeout=10)


class _Done:
    """The end of a ``decode_ahead`` stream (or the error that ended it)."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class decode_ahead:  # noqa: N801 - used as a function that returns an iterator
    """``work(item)`` for each item of ``items``, in order, run by ``pool``'s threads up to ``depth``
    items ahead of the consumer, from the moment it is called: the GPU decodes while the step
    computes. Each result is yielded once the consumer's stream is made to wait for its work (no
    host sync) and its tensors are marked as used on that stream. An exception in a thread is
    raised by ``next``; ``close`` stops reading ``items`` and cancels what has not started."""

    def __init__(self, items: Iterator, work: Callable, pool: DecodePool, depth: int = 4,
                 priority: int = DecodePool.LOOK_AHEAD):
        self.device = pool.device
        self._futures: queue.Queue = queue.Queue(maxsize=depth)  # in order; bounded: at most depth ahead
        self._stop = threading.Event()
        self._finished = False
        self._feeder = threading.Thread(target=self._feed, args=(items, work, pool, priority),
                                        name="megabatch-gpu-decode-feed", daemon=True)
        self._feeder.start()

    def _put(self, value) -> bool:
        while not self._stop.is_set():
            try:
                self._futures.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _feed(self, items: Iterator, work: Callable, pool: DecodePool, priority: int) -> None:
        try:  # the source is read by this one thread, in order
            for item in items:
                if not self._put(pool.submit(work, item, priority)):
                    return
        except BaseException as error:  # handed to the consumer, raised there
            self._put(_Done(error))
            return
        self._put(_Done())

    def __iter__(self) -> decode_ahead:
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        got = self._futures.get()
        if isinstance(got, _Done):
            self._finished = True
            self.close()
            if got.error is not None:
                raise got.error
            raise StopIteration
        try:
            result, event = got.result()
        except BaseException:
            self.close()
            raise
        if event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(event)
            for tensor in _tensors(result):
                if tensor.device.type == "cuda":
                    tensor.record_stream(consumer)  # made on a decode stream, used on this one
        return result

    def close(self) -> None:
        self._finished = True
        self._stop.set()
        self._feeder.join(timeout=10)
        while not self._futures.empty():
            got = self._futures.get_nowait()
            if not isinstance(got, _Done):
                got.cancel()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []
