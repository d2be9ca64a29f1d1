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

from ..config import ConfigError
from .samples import JpegBatch, SubBatch, decode_rgb

log = logging.getLogger(__name__)
def resized_crops(images: list[torch.Tensor], boxes: torch.Tensor, size: tuple[int, int],
                  interpolation: str, chunk_bytes: float = 512e6) -> torch.Tensor:
    """Each uint8 image ``[3, h_i, w_i]`` cut to its box (``boxes [n, 4]``: top, left, height,
    width) and resized to ``size`` as ``F.interpolate(..., antialias=True)`` resizes (bicubic or
    bilinear; nearest without antialiasing), then clamped and rounded to uint8 like the CPU path:
    ``[n, 3, s, s]``. Batched, whatever the crops: each crop-and-resize is two matrix products with
    per-sample resampling matrices (``resample_matrices``: the crop offset is their zero columns),
    in float64 (exact, and free of the TF32 setting), over images of one size at a time: a
    sub-batch costs a few dozen GPU calls, not several per image (from Python, hundreds of small
    calls contend for the interpreter lock with the step's own thread)."""
    device = boxes.device
    out = torch.empty((len(images), 3, *size), dtype=torch.uint8, device=device)
    by_shape: dict[tuple, list[int]] = {}
    for row, image in enumerate(images):
        by_shape.setdefault(tuple(image.shape), []).append(row)
    for (_, height, width), rows in by_shape.items():
        step = max(1, int(chunk_bytes // (3 * height * width * 8)))  # float64 images per chunk
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            index = torch.tensor(chunk, device=device)
            pixels = torch.stack([images[row] for row in chunk]).double()  # [m, 3, H, W]
            crop = boxes[index]
            along_h = resample_matrices(crop[:, 0], crop[:, 2], height, size[0], interpolation)  # [m, s, H]
            along_w = resample_matrices(crop[:, 1], crop[:, 3], width, size[1], interpolation)   # [m, s, W]
            resized = along_h.unsqueeze(1) @ pixels @ along_w.transpose(1, 2).unsqueeze(1)
            out[index] = resized.clamp_(0, 255).round_().to(torch.uint8)
    return out


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

    def __call__(self, batch: JpegBatch) -> torch.Tensor:
        n = len(batch)
        out = torch.empty((n, 3, *batch.size), dtype=torch.uint8, device=self.device)
        cpu_rows = set(batch.cpu_rows)
        gpu_rows = [row for row in range(n) if row not in cpu_rows]
        if gpu_rows:
            images = self._decode([batch.data[row] for row in gpu_rows])
            boxes = batch.boxes[gpu_rows].clone()
            for index, image in enumerate(images):
                if image is None:  # nothing decodes it: a black image, counted in _decode
                    images[index] = torch.zeros((3, 1, 1), dtype=torch.uint8, device=self.device)
                    boxes[index] = torch.tensor([0, 0, 1, 1])
            pixels = resized_crops(images, boxes.to(self.device, non_blocking=True), batch.size, batch.interpolation)
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
