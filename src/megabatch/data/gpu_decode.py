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
of the step, for phase 1 and for the offload replay alike.

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

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .samples import JpegBatch, SubBatch, decode_rgb

log = logging.getLogger(__name__)
# F.interpolate(mode, antialias=True, align_corners=False)'s kernels
_ANTIALIASED = {"bicubic": torch._C._nn._upsample_bicubic2d_aa, "bilinear": torch._C._nn._upsample_bilinear2d_aa}


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

    def __call__(self, batch: JpegBatch) -> torch.Tensor:
        n = len(batch)
        out = torch.empty((n, 3, *batch.size), dtype=torch.uint8, device=self.device)
        cpu_rows = set(batch.cpu_rows)
        gpu_rows = [row for row in range(n) if row not in cpu_rows]
        if gpu_rows:
            images = self._decode([batch.data[row] for row in gpu_rows])
            boxes = batch.boxes[gpu_rows].tolist()
            black = torch.zeros((1, 3, *batch.size), device=self.device)  # for a row nothing decodes
            crops = [self._resize(image, box, batch) if image is not None else black
                     for image, box in zip(images, boxes, strict=True)]
            # the CPU path's order: interpolate in float, clamp, round, back to uint8
            pixels = torch.cat(crops).clamp_(0, 255).round_().to(torch.uint8)
            out[torch.tensor(gpu_rows, device=self.device)] = pixels
        if cpu_rows:
            out[torch.tensor(batch.cpu_rows, device=self.device)] = batch.decoded.to(self.device, non_blocking=True)
        return out

    def sub_batch(self, sub: SubBatch) -> SubBatch:
        """``sub`` with its images on the device: its JPEGs decoded there. An all-JPEG sub-batch keeps
        its crop boxes (``SubBatch.boxes``): the offload replay cuts them again without redrawing."""
        if isinstance(sub.images, JpegBatch):
            boxes = None if sub.images.cpu_rows else sub.images.boxes
            return sub._replace(images=self(sub.images), boxes=boxes)
        return sub._replace(images=sub.images.to(self.device, non_blocking=True))

    @staticmethod
    def _resize(image: torch.Tensor, box: list[int], batch: JpegBatch) -> torch.Tensor:
        """One crop, resized in float as ``F.interpolate(..., antialias=True)`` does (its kernels
        called directly: a sub-batch makes hundreds of these calls from Python)."""
        top, left, height, width = box
        crop = image[:, top:top + height, left:left + width].unsqueeze(0).float()
        resize = _ANTIALIASED.get(batch.interpolation)
        if resize is None:  # nearest
            return F.interpolate(crop, size=batch.size, mode=batch.interpolation)
        return resize(crop, list(batch.size), False, None)

    def _decode(self, data: list[bytes]) -> list[torch.Tensor | None]:
        """nvJPEG on the whole list at once; if it refuses the list, row by row, a row it refuses on
        the CPU, and a row nothing decodes as ``None`` (counted)."""
        from torchvision.io import ImageReadMode, decode_jpeg

        encoded = [torch.frombuffer(bytearray(item), dtype=torch.uint8) for item in data]
        try:
            return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pass
        images = []
        for item, raw in zip(encoded, data, strict=True):
            try:
                images.append(decode_jpeg([item], mode=ImageReadMode.RGB, device=self.device)[0])
                continue
            except RuntimeError:
                pass
            try:
                images.append(decode_rgb(raw).to(self.device))
            except Exception as error:  # noqa: BLE001 - any decoder failure means a corrupt image
                self.corrupt_image += 1
                log.warning("an image whose JPEG header reads well does not decode (%s): a black image "
                            "takes its place in the sub-batch (%d so far)", error, self.corrupt_image)
                images.append(None)
        return images


class _Done:
    """The end of a ``decode_ahead`` stream (or the error that ended it)."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def decode_ahead(items: Iterator, work: Callable, device: torch.device, depth: int = 4,
                 threads: int = 2) -> Iterator:
    """``work(item)`` for each item of ``items``, in order, run by ``threads`` threads (each on its
    own CUDA stream) up to ``depth`` items ahead of the consumer: the GPU decodes while the step
    computes, and one thread's Python (crop boxes, resize calls) overlaps another's nvJPEG call.
    Each result is yielded once the consumer's stream is made to wait for its work (no host sync)
    and its tensors are marked as used on that stream. An exception in a thread is raised here;
    closing the generator stops the threads."""
    from concurrent.futures import ThreadPoolExecutor

    local = threading.local()

    def on_own_stream(item):
        if not hasattr(local, "stream"):
            local.stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(local.stream):
            result = work(item)
            event = torch.cuda.Event()
            event.record(local.stream)
        return result, event

    pool = ThreadPoolExecutor(threads, thread_name_prefix="megabatch-gpu-decode")
    futures: queue.Queue = queue.Queue(maxsize=depth)  # in order; bounded: at most depth ahead
    stop = threading.Event()

    def put(value) -> bool:
        while not stop.is_set():
            try:
                futures.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def feed() -> None:  # the source is read by this one thread, in order
        try:
            for item in items:
                if not put(pool.submit(on_own_stream, item)):
                    return
        except BaseException as error:  # handed to the consumer, raised there
            put(_Done(error))
            return
        put(_Done())

    feeder = threading.Thread(target=feed, name="megabatch-gpu-decode-feed", daemon=True)
    feeder.start()
    try:
        while True:
            got = futures.get()
            if isinstance(got, _Done):
                if got.error is not None:
                    raise got.error
                return
            result, event = got.result()
            consumer = torch.cuda.current_stream(device)
            consumer.wait_event(event)
            for tensor in _tensors(result):
                if tensor.device.type == "cuda":
                    tensor.record_stream(consumer)  # made on a decode stream, used on this one
            yield result
    finally:
        stop.set()
        feeder.join(timeout=10)
        pool.shutdown(wait=True, cancel_futures=True)


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []
