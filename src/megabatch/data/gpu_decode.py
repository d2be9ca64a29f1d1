"""JPEG decoding on the GPU (``data.decode=gpu``): nvJPEG, on the GPU's hardware JPEG decoders
where it has them (``data/nvjpeg.py``), else through ``torchvision.io.decode_jpeg``.

With ``data.decode=cpu`` every loader worker decodes, crops and resizes its samples: at 1M samples
a step the host cores, not the GPU, set the pace (a host's cores decode fewer images a second than
a ViT-B/32's graph-free forward encodes), and data offload decodes every image twice. With
``gpu`` the workers only read tar members, keep the bytes and read each JPEG's header; the crop box
is still drawn on the CPU from the sample's seed (``SampleDecoder.box``, the CPU path's own
function), so the GPU cuts the same crop. ``GpuDecoder.decode`` decodes a sub-batch's JPEGs in one
batched nvJPEG call per decoder (the hardware one for the JPEGs it takes, the CUDA one for the
rest); ``GpuDecoder.finish`` cuts each box and resizes it with the model's interpolation
(antialiased, as the CPU path does) and rounds to uint8: ``[n, 3, s, s]`` on the device, as the CPU
path's tensors are once copied there. ``decode_ahead`` runs both in the threads of a
``DecodePool`` (each on its own high-priority CUDA stream), ahead of the step within a byte budget,
for phase 1 and for the offload replay alike, the replay's sub-batches first: the step's thread
takes finished images and waits for nothing it could have done earlier (``finish`` in the step's
thread would add its crops' time to every sub-batch).

Pixels: decoding the same bytes twice on the GPU gives the same tensor bit for bit (the replay
relies on it). Against the CPU path (libjpeg-turbo) they are equal for 4:4:4 JPEGs; for chroma-
subsampled ones (4:2:0, most photos) nvJPEG upsamples the chroma differently, so pixels differ by
a few levels on average (more at sharp colour edges).

Rows the GPU does not decode (PNG, WebP, CMYK JPEGs, ...) come decoded by the workers as on the CPU path
(``probe_jpeg``); a JPEG nvJPEG refuses is decoded on the CPU instead, and one nothing can decode
(its header read well, its body is corrupt) becomes a black image, counted as ``corrupt_image``
and logged: the sample is already in the sub-batch, and sub-batches keep their size.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import ConfigError
from ..kernels.packed_patches import COORD_BYTES, row_bytes
from ..kernels.resample import resample_matrices, taps
from ..runtime.files import replace_json
from .samples import JpegBatch, SubBatch, decode_rgb

log = logging.getLogger(__name__)

KEPT_HARDWARE_FILE = "jpeg_hardware.json"  # under data.cache_dir: whether each GPU's hardware JPEG decoder works


def resized_crops(images: list[torch.Tensor], boxes: torch.Tensor, size: tuple[int, int],
                  interpolation: str, chunk_bytes: float = 128e6, kernel: bool | None = None) -> torch.Tensor:
    """Each uint8 image ``[3, h_i, w_i]`` (on the GPU) cut to its box (``boxes [n, 4+]`` on the CPU:
    top, left, height, width) and resized to ``size``: ``cropped_groups`` on the images grouped by size."""
    return cropped_groups(stacked_by_size(images), boxes, size, interpolation, chunk_bytes, kernel)


def stacked_by_size(images: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """``(indices, pixels [m, 3, h, w])`` for each image size among ``images``, in first-seen order."""
    by_shape: dict[tuple, list[int]] = {}
    for index, image in enumerate(images):
        by_shape.setdefault(tuple(image.shape), []).append(index)
    return [(indices, torch.stack([images[index] for index in indices])) for indices in by_shape.values()]


def cropped_groups(groups: list[tuple], boxes: torch.Tensor, size: tuple[int, int], interpolation: str,
                   chunk_bytes: float = 128e6, kernel: bool | None = None) -> torch.Tensor:
    """Rows ``rows`` of a batch as uint8 images ``pixels [m, 3, h, w]`` of one size (on the GPU), per
    ``(rows, pixels)`` group, each row cut to its box (``boxes [n, 4+]`` on the CPU: top, left,
    height, width) and resized to ``size`` as ``F.interpolate(..., antialias=True)`` resizes (bicubic
    or bilinear; nearest without antialiasing), then clamped and rounded to uint8 like the CPU path:
    ``[n, 3, s, s]`` in the batch's row order. Batched, whatever the crops, in float64: exact to the
    final rounding, and the same inputs give the same bits, which the replay needs. Not fp32: TF32
    is one switch for the whole process, which the step's loss turns while the decoding threads run
    this beside it.

    ``kernel`` (``None``: on CUDA, unless ``TRITON_INTERPRET=1``): two Triton passes a chunk
    (``kernels/crops.py``: down the rows, then along the columns, each output pixel reading only its
    filter's taps). Otherwise (CPUs, and the kernel's reference) two dense products a chunk with
    per-sample resampling matrices from ``resample_matrices`` (the crop offset is their zero
    columns). ``chunk_bytes`` bounds the float64 held at once. Nothing here waits for the GPU: the
    boxes and the row order travel in page-locked memory (a pageable copy would wait for every
    kernel queued before it)."""
    from ..kernels.triton_tiles import interpreting

    n = len(boxes)
    device = groups[0][1].device if groups else boxes.device
    if kernel is None:
        kernel = device.type == "cuda" and not interpreting()
    if kernel:
        from ..kernels.crops import resize_crops

    order = [row for rows, _ in groups for row in (rows.tolist() if torch.is_tensor(rows) else rows)]  # by size
    boxes = boxes[order] if order != list(range(n)) else boxes
    on_device = to_device(boxes, device)
    out = torch.empty((n, 3, *size), dtype=torch.uint8, device=device)
    done = 0
    for _, images in groups:
        count, _, height, width = images.shape
        held = 3 * size[0] * width if kernel else 3 * height * width  # float64 values an image, at most
        step = max(1, int(chunk_bytes // (held * 8)))
        crops, cpu_crops = on_device[done:done + count], boxes[done:done + count]
        taps_h, taps_w = taps(cpu_crops[:, 2], size[0], interpolation), taps(cpu_crops[:, 3], size[1], interpolation)
        if kernel:
            resize_crops(images, crops, out[done:done + count], interpolation, taps_h, taps_w, step)
        else:
            for start in range(0, count, step):
                rows = slice(start, min(start + step, count))
                out[done + start:done + rows.stop] = dense_crops(images[rows], crops[rows], size, interpolation,
                                                                 taps_h, taps_w)
        done += count
    return in_row_order(out, order)


def dense_crops(images: torch.Tensor, crop: torch.Tensor, size: tuple[int, int], interpolation: str,
                taps_h: int, taps_w: int, own_sizes: bool = False) -> torch.Tensor:
    """``cropped_groups``' plain-torch form for one chunk: ``images [m, 3, h, w]`` uint8 cut to
    ``crop [m, 4+]`` (on their device) and resized to ``size``, as two float64 products with
    per-sample resampling matrices; uint8 ``[m, 3, s, s]``. ``own_sizes``: each row resized to its own size
    (``crop``'s columns 7 and 8, at most ``size``), at the top left of the ``size`` canvas (what lies past it is
    left undefined)."""
    m, _, height, width = images.shape
    out_h, out_w = (crop[:, 7], crop[:, 8]) if own_sizes else (size[0], size[1])
    # rows first, the three channels side by side: [m, H, 3W] (one product per sample, no broadcast
    # copies of the resampling matrices)
    pixels = images.permute(0, 2, 1, 3).reshape(m, height, 3 * width)
    along_h = resample_matrices(crop[:, 0], crop[:, 2], height, out_h, interpolation, torch.float64, taps_h,
                                rows=size[0])
    along_w = resample_matrices(crop[:, 1], crop[:, 3], width, out_w, interpolation, torch.float64, taps_w,
                                rows=size[1])
    tall = torch.bmm(along_h, pixels.double()).view(m, size[0] * 3, width)  # [m, s*3, W]
    resized = torch.bmm(tall, along_w.transpose(1, 2)).view(m, size[0], 3, size[1])  # [m, s, 3, s]
    return resized.clamp_(0, 255).round_().permute(0, 2, 1, 3)


def packed_groups(groups: list[tuple], boxes: torch.Tensor, size: tuple[int, int], interpolation: str,
                  chunk_bytes: float = 128e6) -> torch.Tensor:
    """A NaFlex tower's ``cropped_groups``: each row (of ``groups``, as there) cut to its box, resized to its own
    size (``boxes``' columns 7 and 8, ``NaFlexSpec.gpu_row``: the aspect ratio kept, whole patches) as
    ``dense_crops`` resizes, cut into patches and packed with their coordinates as ``NaFlexSpec.patches`` packs
    them: uint8 ``[n, L, 3 p^2 + 4]`` on the device, ``size`` ``(L, p)``, zero rows after each image's patches.
    Each image size's rows are resized together, whatever their crops and sizes (on a canvas of the largest:
    a loop over the resized sizes made a sub-batch of 1,024 images hundreds of small launches, ~6k images a
    second on an H200), and their patches gathered into place on the device; the boxes go in one copy and nothing
    waits for the GPU. ``chunk_bytes`` bounds the float64 held at once (~7 MB an image of 256 x 384)."""
    length, patch = size
    device = groups[0][1].device
    count = sum(len(rows) for rows, _ in groups)
    out = torch.empty((count, length, row_bytes(patch)), dtype=torch.uint8, device=device)
    on_device = to_device(boxes, device)
    slots = torch.arange(length, device=device)[None, :]  # [1, L]
    order: list[int] = []
    done = 0
    for rows, pixels in groups:
        rows = torch.as_tensor(rows, dtype=torch.int64)
        cpu = boxes[rows].double()
        canvas = (int(cpu[:, 7].max()), int(cpu[:, 8].max()))  # the largest resized size: whole patches
        grid_w = canvas[1] // patch
        taps_h, taps_w = taps(cpu[:, 2], cpu[:, 7], interpolation), taps(cpu[:, 3], cpu[:, 8], interpolation)
        crops = on_device[to_device(rows, device)]
        per_row = 8 * 3 * (pixels.shape[2] * pixels.shape[3] + canvas[0] * (pixels.shape[3] + canvas[1]))
        step = max(1, int(chunk_bytes // per_row))
        for start in range(0, len(rows), step):
            stop = min(start + step, len(rows))
            crop = crops[start:stop]
            resized = dense_crops(pixels[start:stop], crop, canvas, interpolation, taps_h, taps_w,
                                  own_sizes=True).to(torch.uint8)  # [m, 3, H, W]
            # timm's patchify_image: row-major patches, each its pixels row by row with the channels last
            grid = resized.reshape(stop - start, 3, canvas[0] // patch, patch, grid_w, patch)
            grid = grid.permute(0, 2, 4, 3, 5, 1).reshape(stop - start, -1, 3 * patch * patch)
            # slot k of a row with its own grid of w patches a row: patch (k // w, k % w) of the canvas's grid
            own_w = (crop[:, 8] // patch).long()[:, None]
            valid = slots < (crop[:, 7] // patch).long()[:, None] * own_w  # [m, L]
            y, x = torch.div(slots, own_w, rounding_mode="floor"), slots % own_w
            source = torch.where(valid, y * grid_w + x, 0)
            block = out[done:done + stop - start]
            block[..., :-COORD_BYTES] = torch.gather(grid, 1, source[..., None].expand(-1, -1, grid.shape[2])) * \
                valid[..., None]
            y, x = (y + 1) * valid, (x + 1) * valid  # packed_patches' layout: row + 1, column + 1, two bytes each
            block[..., -COORD_BYTES:] = torch.stack([y // 256, y % 256, x // 256, x % 256], dim=2).to(torch.uint8)
            done += stop - start
        order += rows.tolist()
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


class Decoded(NamedTuple):
    """A ``JpegBatch`` decoded on the GPU but not yet cut: ``groups``, the full decoded images of the
    rows the GPU decoded (``gpu_rows``) as ``(rows, pixels [m, 3, h, w])`` per image size, ``rows``
    indexing ``gpu_rows``; their crop ``boxes`` (CPU); and the other rows' crops (``cpu_images``, on
    the device), for ``GpuDecoder.finish``."""

    groups: list
    boxes: torch.Tensor | None
    gpu_rows: list
    cpu_images: torch.Tensor | None
    cpu_rows: list
    size: tuple
    interpolation: str
    naflex: bool = False  # JpegBatch.naflex: packed patches [n, L, 3 p^2 + 4], not crops


class GpuDecoder:
    """Turns a ``JpegBatch`` into uint8 images ``[n, 3, s, s]`` on ``device``, on the current CUDA
    stream, in two halves: ``decode`` (nvJPEG: one call that waits for the GPU) and ``finish`` (the
    crops and resizes: a few dozen short GPU calls that wait for nothing, and change no setting the
    step's thread reads). A decoding thread runs both (``sub_batch``, ``__call__``).

    Two decoders: the GPU's hardware JPEG engines (``data/nvjpeg.py``, one decoder per thread) for
    the JPEGs they take (``JpegHeader.hardware``), where the GPU has them and ``hardware`` allows
    (``None``: wherever they exist); nvJPEG's CUDA decoder through ``torchvision.io.decode_jpeg``
    for the others. Both give the same pixels, bit for bit, and a row
    takes the same path every time it is decoded. ``corrupt_image``: rows nothing could decode
    (black images), counted for the logs."""

    def __init__(self, device: torch.device, hardware: bool | None = None, threads: int | None = None,
                 kept: Path | None = None):
        self.device, self.threads = device, threads
        self.corrupt_image = 0
        self.hardware = hardware if device.type == "cuda" else False
        self.kept = kept  # a file keeping, per GPU, whether its hardware decoder works (``_has_hardware``)
        self._deciding = threading.Lock()  # the decoding threads' first tries: one decides, logs and keeps
        self._pool: DecodePool | None = None

    @property
    def pool(self) -> DecodePool:
        """The decoding threads (``DecodePool``), started on first use: ``threads`` (``data.
        decode_threads``), all but one for the look-ahead while a replay runs, else with the hardware
        decoders four (each its own decoder), three of them for the look-ahead then, and with nvJPEG's
        CUDA decoder alone, which decodes one call at a time (a mutex in torchvision), two, one for the
        look-ahead then. Without a replay (phase 1, a plain step) the look-ahead takes every thread.

        Under a training step a hardware decoding call takes several times as long as on an idle GPU
        (nvJPEG waits on an event per image, and each waits for the busy SMs), so the number of
        threads sets the rate: four halve the 1M offload step's wait for images against three, a
        fifth adds little (docs/performance.md)."""
        if self._pool is None:
            if self.threads is not None:
                self._pool = DecodePool(self.device, threads=self.threads, look_ahead_threads=self.threads - 1)
            elif self._has_hardware():
                self._pool = DecodePool(self.device, threads=4, look_ahead_threads=3)
            else:
                self._pool = DecodePool(self.device, threads=2, look_ahead_threads=1)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __call__(self, batch: JpegBatch) -> torch.Tensor:
        return self.finish(self.decode(batch))

    def decode(self, batch: JpegBatch) -> Decoded:
        n, cpu_rows = len(batch), set(batch.cpu_rows)
        gpu_rows = [row for row in range(n) if row not in cpu_rows]
        groups, boxes = [], None
        if gpu_rows:
            boxes = batch.boxes if not cpu_rows else batch.boxes[gpu_rows]
            groups, boxes = self._decode(batch.data, gpu_rows, boxes)
        cpu_images = to_device(batch.decoded, self.device) if cpu_rows else None
        return Decoded(groups, boxes, gpu_rows, cpu_images, list(batch.cpu_rows), batch.size, batch.interpolation,
                       batch.naflex)

    def finish(self, decoded: Decoded | torch.Tensor) -> torch.Tensor:
        """The uint8 crops ``[n, 3, s, s]`` of a ``decode`` result (a tensor is returned as it is); a NaFlex
        tower's packed patches ``[n, L, 3 p^2 + 4]`` (``packed_groups``)."""
        if torch.is_tensor(decoded):
            return decoded
        parts = []
        if decoded.gpu_rows:
            cut = packed_groups if decoded.naflex else cropped_groups
            parts.append(cut(decoded.groups, decoded.boxes, decoded.size, decoded.interpolation))
        if decoded.cpu_rows:
            parts.append(decoded.cpu_images)
        if not decoded.cpu_rows or not decoded.gpu_rows:
            return parts[0]
        return in_row_order(torch.cat(parts), decoded.gpu_rows + decoded.cpu_rows)

    def sub_batch(self, sub: SubBatch) -> SubBatch:
        """``sub`` with its JPEGs decoded and cut on the device, its other images copied there. An
        all-JPEG sub-batch keeps its crop boxes (``SubBatch.boxes``): the offload replay cuts them
        again without redrawing."""
        if isinstance(sub.images, JpegBatch):
            boxes = None if sub.images.cpu_rows else sub.images.boxes
            return sub._replace(images=self(sub.images), boxes=boxes)
        return sub._replace(images=to_device(sub.images, self.device))

    def _has_hardware(self) -> bool:
        """Whether the hardware JPEG decoder works here, for the pool's size: decided already, or what ``kept`` says
        for this GPU, else found out by making one in this thread (0.7 s of the main thread at the loader's start on
        an H200: the library's search and bind, then nvJPEG's handle), then kept. A kept answer only sizes the pool:
        the decoding threads' first try decides for the run, and says so in the log, as without it."""
        if self.hardware is not None:
            return self.hardware
        key, answers = self._kept_answers()
        if key in answers:
            return bool(answers[key])
        return self._hardware_decoder() is not None  # (kept by _hardware_decoder as it decides)

    def _kept_answers(self) -> tuple[str, dict]:
        """``(this GPU's key, every kept answer)`` from ``kept`` (none where there is no file or it does not read)."""
        if self.kept is None or self.device.type != "cuda":
            return "", {}
        import torchvision

        key = (f"{torch.cuda.get_device_name(self.device)}, CUDA {torch.version.cuda}, "
               f"torchvision {torchvision.__version__}")
        try:
            answers = json.loads(self.kept.read_text()) if self.kept.is_file() else {}
        except (OSError, ValueError):
            answers = {}
        return key, answers if isinstance(answers, dict) else {}

    def _keep_answer(self, works: bool) -> None:
        key, answers = self._kept_answers()
        if key and answers.get(key) is not works:
            try:
                replace_json(self.kept, {**answers, key: works}, indent=1)
            except OSError as error:  # the next run probes again
                log.warning("could not keep whether the GPU's hardware JPEG decoder works in %s (%s)", self.kept,
                            error)

    def _hardware_decoder(self):
        """This thread's hardware decoder (``nvjpeg.HardwareDecoder``), or ``None`` where there is
        none or ``hardware`` is off; the first try decides for the run, and says so in the log."""
        if self.hardware is False:
            return None
        from . import nvjpeg

        try:
            decoder = nvjpeg.hardware_decoder(self.device)
        except (nvjpeg.NvJpegError, OSError, AttributeError) as error:  # (AttributeError: an nvJPEG too old)
            if self.hardware:
                raise RuntimeError(f"the GPU's hardware JPEG decoder was asked for and fails: {error}") from None
            with self._deciding:
                if self.hardware is None:
                    log.info("JPEGs decode with nvJPEG's CUDA decoder (no hardware JPEG decoder: %s)", error)
                    self.hardware = False
                    self._keep_answer(False)
            return None
        with self._deciding:  # (a kept answer sized the pool: the decoding threads' first tries decide)
            if self.hardware is None:
                log.info("JPEGs decode on the GPU's hardware JPEG decoder (nvJPEG), the others with its CUDA "
                         "decoder")
                self.hardware = True
                self._keep_answer(True)
        return decoder

    def _decode(self, data, rows: list[int], boxes: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Rows ``rows`` of ``data`` (``EncodedImages``), whose ``boxes`` rows are theirs, decoded:
        ``(groups, boxes)`` as ``Decoded`` holds them, the boxes of rows nothing decodes made (0, 0,
        1, 1) over a black 1x1 image. The hardware takes the rows it decodes in one call; the rest
        (and all of them if its call fails) go to ``_decode_each``."""
        groups, rest = [], list(range(len(rows)))
        hardware = self._hardware_decoder()
        if hardware is not None:
            takes = torch.nonzero(boxes[:, 6] == 1).flatten()
            if len(takes):
                from .nvjpeg import NvJpegError

                index = torch.tensor(rows, dtype=torch.int64)[takes]
                starts, ends = data.offsets[index], data.offsets[index + 1]
                try:
                    groups = [(takes[local], pixels)
                              for local, pixels in hardware.decode(data.blob, starts, ends - starts, boxes[takes, 4:6])]
                    taken = set(takes.tolist())
                    rest = [local for local in rest if local not in taken]
                except NvJpegError as error:  # a JPEG its header misjudged, a corrupt one: every row below
                    log.warning("the hardware JPEG decoder refused a sub-batch (%s): nvJPEG's CUDA decoder "
                                "decodes it instead", error)
        if not rest:
            return groups, boxes
        encoded = data.views()
        images = self._decode_each([encoded[rows[local]] for local in rest])
        if any(image is None for image in images):
            boxes = boxes.clone()
            for local, image in zip(rest, images, strict=True):
                if image is None:  # nothing decodes it: a black image, counted in _decode_each
                    boxes[local, :4] = torch.tensor([0, 0, 1, 1])
        black = torch.zeros((3, 1, 1), dtype=torch.uint8, device=self.device)
        for indices, pixels in stacked_by_size([black if image is None else image for image in images]):
            groups.append((torch.tensor([rest[index] for index in indices], dtype=torch.int64), pixels))
        return groups, boxes

    def _decode_each(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """nvJPEG's CUDA decoder on the whole list of encoded images (uint8 CPU tensors) at once; if it
        refuses the list, row by row, a row it refuses on the CPU, and a row nothing decodes as
        ``None`` (counted)."""
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
    A task's result comes with an event recorded on its thread's stream after its work. The
    look-ahead keeps ``look_ahead_threads`` busy while a replay stream is open (one thread is always
    free for the replay), and every thread while none is (phase 1 has no replay to leave one to)."""

    REPLAY, LOOK_AHEAD = 0, 1

    def __init__(self, device: torch.device, threads: int = 2, look_ahead_threads: int = 1):
        self.device, self.threads, self.look_ahead_threads = device, threads, look_ahead_threads
        self._replays, self._replays_lock = 0, threading.Lock()  # replay streams open
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

    def look_ahead_limit(self) -> int:
        """Threads the look-ahead may keep busy now."""
        return self.look_ahead_threads if self._replays else self.threads

    def replay_opened(self, count: int = 1) -> None:
        """A replay stream opened (``count`` 1) or closed (-1)."""
        with self._replays_lock:
            self._replays += count

    def _run(self) -> None:
        # the highest priority: a decode's few kernels go before the step's queued ones, so the
        # images the step waits for are not decoded behind it
        stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        try:
            self._serve(stream)
        finally:
            from .nvjpeg import release_thread_decoders

            release_thread_decoders()  # this thread's hardware decoders, if it made any

    def _serve(self, stream) -> None:
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


# Seconds that consumers of ``decode_ahead`` waited, process-wide, by stream (``look_ahead``: phase 1
# and plain steps; ``replay``: the offload replay) and by what they waited for: ``source`` (the item
# not read yet: the loader) or ``decode`` (its decoding not finished); ``first``: the part of both
# spent on each stream's first item (start-up: the loader's workers starting). Read by the benchmarks
# (``scripts/benchmarks/end_to_end.py``) to say which side a step's data wait is on.
wait_seconds: collections.Counter = collections.Counter()


class _Done:
    """The end of a ``decode_ahead`` stream (or the error that ended it)."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class decode_ahead:  # noqa: N801 - used as a function that returns an iterator
    """``work(item)`` for each item of ``items``, in order, run by ``pool``'s threads from the moment
    it is called, up to ``depth`` items and ``budget_bytes`` of results (``device_bytes``; at least
    one item) ahead of the consumer: the GPU decodes while the step computes. ``next`` returns a
    result once the consumer's stream is made to wait for its work (no host sync) and its tensors
    are marked as used on that stream. An exception in a thread is raised by ``next``; ``close``
    stops reading ``items`` and cancels what has not started."""

    def __init__(self, items: Iterator, work: Callable, pool: DecodePool, depth: int = 4,
                 priority: int = DecodePool.LOOK_AHEAD, budget_bytes: float = float("inf")):
        self.device, self._budget = pool.device, budget_bytes
        self._futures: queue.Queue = queue.Queue(maxsize=depth)  # in order; bounded: at most depth ahead
        self._held = 0  # bytes of results done and not yet taken
        # submitted and not done: at most one per thread, and for the look-ahead one fewer while a
        # replay stream is open, so that a thread is always free for the replay, whose step is waiting
        self._running = 0
        self._pool, self._look_ahead = pool, priority == DecodePool.LOOK_AHEAD
        self._name = "look_ahead" if self._look_ahead else "replay"
        self._open_replay = not self._look_ahead  # counted in the pool's open replays until closed
        if self._open_replay:
            pool.replay_opened()
        self._room = threading.Condition()
        self._stop = threading.Event()
        self._finished, self._taken = False, 0
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

    def _wait_for_room(self) -> bool:
        """Wait until the results waiting for the consumer are under the budget and a thread is free
        (a result's size is known only once it is done)."""
        with self._room:
            while (self._full() or self._running >= self._threads()) and not self._stop.is_set():
                self._room.wait(timeout=0.1)
            self._running += 1
        return not self._stop.is_set()

    def _threads(self) -> int:
        return self._pool.look_ahead_limit() if self._look_ahead else self._pool.threads

    def _full(self) -> bool:
        return self._held > 0 and self._held >= self._budget  # a budget of 0 still lets one result wait

    def _done(self, future: Future) -> None:
        done = not future.cancelled() and future.exception() is None
        with self._room:
            self._running -= 1
            self._held += device_bytes(future.result()[0]) if done else 0
            self._room.notify_all()

    def _feed(self, items: Iterator, work: Callable, pool: DecodePool, priority: int) -> None:
        try:  # the source is read by this one thread, in order
            for item in items:
                if not self._wait_for_room():
                    return
                future = pool.submit(work, item, priority)
                future.add_done_callback(self._done)
                if not self._put(future):
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
        start = time.perf_counter()
        got = self._futures.get()
        read = time.perf_counter()
        wait_seconds[f"{self._name}_source"] += read - start
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
        finally:
            wait_seconds[f"{self._name}_decode"] += time.perf_counter() - read
            if not self._taken:
                wait_seconds[f"{self._name}_first"] += time.perf_counter() - start
            self._taken += 1
        with self._room:
            self._held -= device_bytes(result)
            self._room.notify_all()
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
        self._close_replay()
        self._feeder.join(timeout=10)
        while not self._futures.empty():
            got = self._futures.get_nowait()
            if not isinstance(got, _Done):
                got.cancel()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        if hasattr(self, "_open_replay"):
            self._close_replay()

    def _close_replay(self) -> None:
        """No longer counted among the pool's open replay streams (once)."""
        if self._open_replay:
            self._open_replay = False
            self._pool.replay_opened(-1)


def device_bytes(result) -> int:
    """Device bytes a decoding result holds: its device tensors', through tuples and lists."""
    return sum(tensor.numel() * tensor.element_size() for tensor in _tensors(result) if tensor.device.type != "cpu")


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []
