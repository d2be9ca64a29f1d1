"""One sample from raw webdataset fields to tensors: decoding, bad-input counting, per-sample
seeded augmentation, and the ``SubBatch`` the training loaders yield."""

from __future__ import annotations

import functools
import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2 as T2

try:
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # a torchvision without image decoding (deprecated since 0.29): PIL decodes
    decode_image = None

from .captions import CaptionKeys
from .image_features import ImageFeatureSpec
from .naflex import NaFlexSpec, UnusableImage
from .transforms import crop_box, resized_crop, seeded

log = logging.getLogger(__name__)
# torchvision >= 0.29 warns on every decode that TorchCodec will take its decoders over one day
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)

IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")
TXT = CaptionKeys("txt")  # the caption of img2dataset's shards
WARN_FIRST = 3  # warnings of one kind a loader worker logs in an epoch; the rest are counted only


@dataclass
class Stats:
    """Counts of bad input, by kind: skipped samples, unreadable shards, and samples used to fill a
    sub-batch beyond what a loader's own shards gave, so that every rank still gets equal batches
    and DDP never hangs: ``stand_in``, the next readable samples at the same place of later batches
    (a sample of another step, never a second copy in this one); ``padded``, borrowed from other
    shards (shard split) or, where nothing else was readable, repeated.

    ``count_shards``: whether this loader reports broken shards (with the position split every
    worker reads every shard: one per rank does). ``give_up_after``: unreadable shards in a row,
    with no sample between them, after which the stream is declared unreadable (an endless
    resampled stream over broken shards would otherwise spin forever)."""

    corrupt_image: int = 0
    missing_caption: int = 0
    missing_negatives: int = 0
    missing_teacher: int = 0  # distill.teacher=stored: no stored embeddings
    bad_teacher: int = 0      # stored embeddings unreadable or of another shape than teacher.json's
    bad_shape: int = 0        # model.image.naflex: a side shorter than a patch, an aspect beyond data.naflex.max_aspect
    broken_shard: int = 0
    stand_in: int = 0
    padded: int = 0
    count_shards: bool = field(default=True, repr=False)
    give_up_after: int = field(default=0, repr=False)
    broken_urls: set = field(default_factory=set, repr=False)
    broken_in_a_row: int = field(default=0, repr=False)
    warned: dict = field(default_factory=dict, repr=False)  # kind -> warnings of that kind met so far

    def warn(self, kind: str, message: str, *args) -> None:
        """Log a bad-input warning of ``kind``: the first ``WARN_FIRST`` of each kind in this loader worker's
        epoch, then one line saying the rest are counted only (the epoch's totals are logged at its end)."""
        seen = self.warned[kind] = self.warned.get(kind, 0) + 1
        if seen <= WARN_FIRST:
            log.warning(message, *args)
        if seen == WARN_FIRST:
            log.warning("further %s warnings of this loader worker are not logged this epoch: each is counted "
                        "(data/%s in the metrics; the epoch's totals are logged at its end)", kind, kind)

    def handler(self, error: Exception) -> bool:
        """webdataset exception handler: count and log a truncated or unreadable tar (once per
        shard, under its URL: the error's last argument, as ``tars.tar_samples`` gives it), go on."""
        url = str(error.args[-1]) if error.args else "?"
        self.broken_in_a_row += 1
        if url not in self.broken_urls:
            self.broken_urls.add(url)
            if self.count_shards:
                self.broken_shard += 1
                self.warn("broken_shard", "skipping the rest of shard %s: %s", url,
                          error.args[0] if error.args else error)
        if self.give_up_after and self.broken_in_a_row >= self.give_up_after:
            raise RuntimeError(f"no readable shard: {self.broken_in_a_row} in a row failed, e.g. "
                               f"{', '.join(sorted(self.broken_urls)[:5])}")
        return True

    def got_sample(self) -> None:
        self.broken_in_a_row = 0

    def as_dict(self) -> dict[str, int]:
        return {"corrupt_image": self.corrupt_image, "missing_caption": self.missing_caption,
                "missing_negatives": self.missing_negatives, "missing_teacher": self.missing_teacher,
                "bad_teacher": self.bad_teacher, "bad_shape": self.bad_shape, "broken_shard": self.broken_shard,
                "stand_in": self.stand_in, "padded": self.padded}

    def report(self) -> dict:
        """What a sub-batch carries to the training process: the counts, and the broken shards' names (the
        same shard met by several workers counts once per epoch and rank there)."""
        return {**self.as_dict(), "broken_urls": tuple(sorted(self.broken_urls))}


@dataclass(eq=False)
class EncodedImages:
    """A sub-batch's encoded images (JPEG, PNG, ... files as read from the tar) as one uint8 tensor
    ``blob`` with row ``i`` at ``offsets[i]:offsets[i + 1]``, and each row's stream ``positions``.

    Why one tensor: a loader worker's result crosses to the training process pickled through a
    pipe, except tensors, which cross as one shared-memory handle. As 512 byte strings (17 MB for
    256 px JPEGs) a sub-batch took hundreds of 64 KB pipe reads, each handing the interpreter lock
    back and forth with the GPU decoding threads and the step, which kept the receiving thread busy
    most of the time. Iterating gives ``(bytes, position)``
    pairs; ``views`` gives each row as a tensor without copying (nvJPEG's input)."""

    blob: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def from_bytes(cls, items: list[bytes], positions: list[int]) -> EncodedImages:
        lengths = torch.tensor([0] + [len(item) for item in items], dtype=torch.int64)
        joined = bytearray().join(items)
        blob = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
        return cls(blob, lengths.cumsum(0), torch.tensor(positions, dtype=torch.int64))

    def __len__(self) -> int:
        return len(self.positions)

    def __iter__(self):
        data, offsets = self.blob.numpy().tobytes(), self.offsets.tolist()
        for row, position in enumerate(self.positions.tolist()):
            yield data[offsets[row]:offsets[row + 1]], position

    def views(self) -> list[torch.Tensor]:
        """Each row's bytes as a uint8 tensor viewing ``blob`` (one call, not one per row)."""
        return list(torch.split(self.blob, self.offsets.diff().tolist()))

    def nbytes(self) -> int:
        return self.blob.numel()

    @classmethod
    def join(cls, parts: list[EncodedImages]) -> EncodedImages:
        """``parts``' rows, in order, as one (sub-batches joined: ``data/token_groups.py``)."""
        starts = torch.tensor([0] + [part.nbytes() for part in parts[:-1]], dtype=torch.int64).cumsum(0)
        offsets = [parts[0].offsets] + [part.offsets[1:] + start
                                        for part, start in zip(parts[1:], starts[1:], strict=True)]
        return cls(torch.cat([part.blob for part in parts]), torch.cat(offsets),
                   torch.cat([part.positions for part in parts]))

    def pin_memory(self) -> EncodedImages:
        """The DataLoader's pin thread calls this: the bytes leave shared memory (a tensor received from a loader
        worker lives there and holds a file descriptor as long as it lives, and a step keeps thousands: offload)
        but are not page-locked: nvJPEG and the CPU decoders read ordinary memory, and the offload keeps them."""
        if not self.blob.is_shared():
            return self
        return EncodedImages(self.blob.clone(), self.offsets.clone(), self.positions.clone())


class SubBatch(NamedTuple):
    """What the training loader yields: ``images [n, 3, s, s]``, ``texts [n, ctx]``, ``raw`` (the
    encoded images and stream positions, ``EncodedImages``, for data offload, else ``None``) and
    ``stats`` (the producing worker's cumulative ``Stats`` counts, with its ``worker`` id)."""

    images: torch.Tensor
    texts: torch.Tensor
    raw: EncodedImages | None
    stats: dict | None = None
    boxes: torch.Tensor | None = None  # data.decode=gpu: the crop boxes of an all-JPEG sub-batch (offload keeps them)
    negatives: torch.Tensor | None = None  # data.train.negatives_key: [n x K, ctx], row i's K hard negatives together
    teacher: torch.Tensor | None = None    # distill.teacher=stored: [n, members, 2, width] (image, caption) embeddings


class Texts(NamedTuple):
    """A sample's caption with what rides along: its hard negatives (``data.train.negatives_key``) and
    its stored teacher embeddings (``data.train.teacher_key``), each ``None`` when not read."""

    caption: str
    negatives: list[str] | None = None
    teacher: np.ndarray | None = None


def open_image(image_bytes: bytes | None) -> Image.Image:
    """Decode encoded image bytes (raises on a corrupt or missing image)."""
    if image_bytes is None:
        raise ValueError("no image file in the sample")
    image = Image.open(io.BytesIO(image_bytes))
    image.load()
    return image


def decode_rgb(image_bytes: bytes | None) -> torch.Tensor:
    """Decode encoded image bytes to a uint8 RGB tensor ``[3, h, w]`` (raises on a corrupt, truncated
    or missing image). torchvision's libjpeg-turbo/libpng/libwebp decoders write the tensor directly,
    about twice as fast per training sample as PIL plus a PIL resize; formats they do not read
    (BMP, TIFF, ...) go through PIL."""
    if image_bytes is None:
        raise ValueError("no image file in the sample")
    if decode_image is not None:
        try:
            return decode_image(torch.frombuffer(bytearray(image_bytes), dtype=torch.uint8),
                                mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # a format torchvision does not read, or a corrupt file: PIL decides below
    image = open_image(image_bytes).convert("RGB")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


def decode_checked(spec: NaFlexSpec, image_bytes: bytes | None) -> torch.Tensor:
    """``decode_rgb``, then ``UnusableImage`` for a shape a NaFlex tower cannot take (``NaFlexSpec.check``)."""
    return spec.check(decode_rgb(image_bytes))


def probe_checked(spec: NaFlexSpec, image_bytes: bytes | None) -> JpegHeader | torch.Tensor:
    """``probe_jpeg`` (``data.decode=gpu``), then ``UnusableImage`` for a shape a NaFlex tower cannot take, read from
    the JPEG's header or the pixels the worker decoded."""
    image = probe_jpeg(image_bytes)
    if isinstance(image, JpegHeader):
        spec.check_size(image.height, image.width)
        return image
    return spec.check(image)


def decode_pair(sample: dict, stats: Stats, decode: Callable = open_image, captions: CaptionKeys = TXT,
                position: int = 0, image_keys: tuple[str, ...] = IMAGE_KEYS) -> tuple[bytes, object, str] | None:
    """(image bytes, ``decode(bytes)``, caption) from a raw sample, or ``None`` (counted) when
    unusable. Evaluation decodes to PIL (its transforms are the reference evaluator's); training to
    uint8 tensors (``decode_rgb``). ``captions``: which caption (``data.train.text_key``; the draw among
    several seeded by the sample's ``position``). ``image_keys``: the members that hold the image, the first
    present taken (``model.image_features=stored``: the stored features' member, ``decode`` its reader)."""
    caption = captions.pick(sample, position)
    if caption is None:
        stats.missing_caption += 1
        stats.warn("missing_caption", "skipping %s: no caption (%s)", sample.get("__key__"), captions.describe())
        return None
    negatives = teacher = None
    if captions.negatives_key is not None:  # data.train.negatives_key: the caption's hard negatives
        negatives = captions.negatives_of(sample)
        if negatives is None:
            stats.missing_negatives += 1
            stats.warn("missing_negatives", "skipping %s: no hard negatives (%s)", sample.get("__key__"),
                       captions.negatives_key)
            return None
    if captions.teacher is not None:  # distill.teacher=stored: the sample's teacher embeddings
        teacher = captions.teacher.read(sample)
        if teacher is None or isinstance(teacher, str):
            if teacher is None:
                stats.missing_teacher += 1
            else:
                stats.bad_teacher += 1
            stats.warn("bad_teacher", "skipping %s: %s teacher embeddings (%s, [%d, 2, %d] expected)",
                       sample.get("__key__"), "no" if teacher is None else "unreadable or misshapen",
                       captions.teacher.key, captions.teacher.members, captions.teacher.width)
            return None
    if negatives is not None or teacher is not None:
        caption = Texts(caption, negatives, teacher)
    image_bytes = next((sample[k] for k in image_keys if k in sample), None)
    try:
        image = decode(image_bytes)
    except UnusableImage as error:  # decoded, but of a shape the NaFlex tower cannot take
        stats.bad_shape += 1
        stats.warn("bad_shape", "skipping %s: %s", sample.get("__key__"), error)
        return None
    except Exception as error:  # noqa: BLE001 - any decoder failure means a corrupt sample
        stats.corrupt_image += 1
        stats.warn("corrupt_image", "skipping %s: undecodable image (%s)", sample.get("__key__"), error)
        return None
    return image_bytes, image, caption


@dataclass(frozen=True)
class JpegHeader:
    """A JPEG the GPU decodes (``data.decode=gpu``), as far as a loader worker reads it: its header.
    ``hardware``: nvJPEG's hardware decoder takes it (``data/nvjpeg.py``: 8-bit baseline, grayscale
    or 4:4:4, 4:2:2, 4:2:0 chroma); the others go to nvJPEG's CUDA decoder."""

    height: int
    width: int
    hardware: bool = False


def probe_jpeg(image_bytes: bytes | None) -> JpegHeader | torch.Tensor:
    """``data.decode=gpu``'s decoder in a loader worker: the header of a complete baseline or
    progressive JPEG in RGB or grayscale (nvJPEG decodes it on the GPU later), read without decoding;
    any other image decoded here (``decode_rgb``: raises on a corrupt one, which is skipped and
    counted as on the CPU path). A JPEG cut short (no end-of-image marker) is decoded here too, so
    that its error is raised, and counted, in the worker."""
    if image_bytes and image_bytes[:3] == b"\xff\xd8\xff" and image_bytes.rstrip(b"\x00")[-2:] == b"\xff\xd9":
        try:
            with Image.open(io.BytesIO(image_bytes)) as image:
                if image.format == "JPEG" and image.mode in ("RGB", "L"):
                    return JpegHeader(image.height, image.width, hardware_decodes(image))
        except Exception:  # noqa: BLE001 - an unreadable header: decode_rgb below decides
            pass
    return decode_rgb(image_bytes)


def hardware_decodes(image: Image.Image) -> bool:
    """Whether nvJPEG's hardware decoder takes this opened JPEG: one baseline scan of 8-bit samples
    in grayscale or YCbCr with 4:4:4, 4:2:2 or 4:2:0 chroma (the engines also refuse 4:1:1 and
    4:1:0; PIL reads 4:4:0 as "unknown", and it goes to the CUDA decoder too)."""
    from PIL import JpegImagePlugin

    if image.info.get("progressive") or image.info.get("progression") or getattr(image, "bits", 8) != 8:
        return False
    return image.mode == "L" or JpegImagePlugin.get_sampling(image) in (0, 1, 2)


NAFLEX_ROW = 10  # a NaFlex JpegBatch's boxes columns: the 7 below, the resized size (height, width), the length


class JpegBatch(NamedTuple):
    """A sub-batch's images left for the GPU to decode (``data.decode=gpu``; ``data/gpu_decode.py``).

    ``data``: the rows' encoded bytes (``EncodedImages``); ``boxes [n, 7]`` int64: each row's crop (top, left, height,
    width), drawn on the CPU from the sample's seed (``SampleDecoder.box``), then its image's height, width and
    whether nvJPEG's hardware decoder takes it (``JpegHeader``; zeros for CPU rows); ``cpu_rows``: rows the
    GPU does not decode (not a JPEG nvJPEG reads), already decoded and cropped, ``decoded [k, 3, s,
    s]`` uint8; ``size`` ``(s, s)`` and ``interpolation``: the training crop's.

    ``naflex`` (a NaFlex tower's, ``NaFlexSpec.gpu_row``): each row of ``boxes`` also holds the size its crop is
    resized to and the sequence length it is packed to (``NAFLEX_ROW`` columns); ``size`` is ``(L, patch)``, the
    sub-batch's length and the patch size, and ``decoded`` the CPU rows' packed patches ``[k, L, 3 p^2 + 4]``."""

    data: EncodedImages
    boxes: torch.Tensor
    cpu_rows: list
    decoded: torch.Tensor | None
    size: tuple
    interpolation: str
    naflex: bool = False  # a NaFlex tower's patches (boxes [n, NAFLEX_ROW], size (L, patch), decoded [k, L, row])

    def __len__(self) -> int:
        return len(self.data)


class SampleDecoder:
    """Image tensor of the sample at ``position`` of an epoch's stream, augmented with randomness
    seeded by (seed, epoch, position) alone: decoding the same bytes again gives the same tensor,
    whichever process does it and whenever (the GradCache data offload relies on this).

    ``gpu``: ``data.decode=gpu``: ``decode`` reads only JPEG headers (``probe_jpeg``) and a JPEG's
    sample becomes its crop box; ``collate`` then makes a ``JpegBatch`` whose pixels the GPU makes
    (``data/gpu_decode.py``) with the same box, drawn here from the same seed.

    ``transform`` an ``ImageFeatureSpec`` (``model.image_features=stored``): a sample's "image" is its
    stored features (``[width]``, read from the spec's member), taken as they are: nothing is decoded or
    augmented, and a sub-batch's images are ``[n, width]``.

    ``transform`` a ``NaFlexSpec`` (``model.image.naflex``): a sample's image (one of a shape the tower cannot take
    raises ``UnusableImage``: skipped, counted as ``bad_shape``) is cropped at random (``data.train.augment``'s
    ranges, relative to its aspect ratio), resized with its aspect ratio kept to the sequence length drawn for its
    position and cut into patches; ``collate`` packs a sub-batch's, uint8
    ``[n, L, 3 p^2 + 4]`` (``data/naflex.py``)."""

    def __init__(self, transform, seed: int, epoch: int, gpu: bool = False,
                 captions: CaptionKeys | None = None):
        self.transform, self.seed, self.epoch = transform, seed, epoch
        self.decode = probe_jpeg if gpu else decode_rgb
        self.image_keys = IMAGE_KEYS
        self.stored = isinstance(transform, ImageFeatureSpec)
        if self.stored:
            self.decode, self.image_keys = transform.decode, (transform.key,)
        self.naflex = isinstance(transform, NaFlexSpec)
        if self.naflex:  # (partials are picklable: a fork server's workers)
            self.decode = functools.partial(probe_checked if gpu else decode_checked, transform)
        # data.train.text_key: which caption, drawn with (seed, epoch, position) as the augmentation is
        self.captions = (captions or TXT).for_epoch(seed, epoch)

    def sample_seed(self, position: int) -> int:
        return (self.seed * 1_000_003 + self.epoch) * 10_000_019 + position

    def box(self, height: int, width: int, position: int) -> tuple[int, int, int, int]:
        """The random-resized-crop box ``(top, left, height, width)`` of the sample at ``position``
        in an image of ``height x width``: a pure function of them and the seed, shared by the CPU
        and GPU paths (``transforms.crop_box``)."""
        return crop_box(self.transform, height, width, self.sample_seed(position))

    def __call__(self, image: torch.Tensor | bytes | JpegHeader, position: int):
        """The uint8 ``[3, s, s]`` crop of ``image`` (bytes are decoded first); a ``JpegHeader``
        gives its box instead (the GPU cuts it), followed by the header (``JpegBatch.boxes``'s row).
        Stored features: ``image`` as it is. A NaFlex tower's: its patches (``NaFlexSpec.patches``)."""
        if self.stored:
            return image
        if self.naflex:
            if isinstance(image, bytes):
                image = decode_checked(self.transform, image)
            seq_len = self.transform.seq_len(self.seed, self.epoch, position)
            if isinstance(image, JpegHeader):
                return self.transform.gpu_row(image.height, image.width, image.hardware, seq_len,
                                              self.sample_seed(position))
            return self.transform.patches(image, seq_len, self.sample_seed(position))
        if isinstance(image, JpegHeader):
            return (*self.box(image.height, image.width, position), image.height, image.width, int(image.hardware))
        if isinstance(image, bytes):
            image = decode_rgb(image)
        if isinstance(self.transform, T2.RandomResizedCrop):
            return resized_crop(self.transform, image, self.box(image.shape[-2], image.shape[-1], position))
        return seeded(self.transform, image, self.sample_seed(position))

    def collate(self, images: list, data: EncodedImages | None) -> torch.Tensor | JpegBatch:
        """Stack a sub-batch's ``__call__`` results (``data``: the rows' encoded images); with any
        box among them, a ``JpegBatch``; a NaFlex tower's patches padded to the longest."""
        if all(torch.is_tensor(image) for image in images):
            return self.transform.collate(images) if self.naflex else torch.stack(images)
        cpu_rows = [row for row, image in enumerate(images) if torch.is_tensor(image)]
        width = NAFLEX_ROW if self.naflex else 7
        boxes = torch.tensor([(0,) * width if torch.is_tensor(image) else image for image in images],
                             dtype=torch.int64)
        if self.naflex:  # the CPU's rows packed to the sub-batch's length (the longest row's, GPU's or CPU's)
            length = max(image.shape[0] if torch.is_tensor(image) else image[-1] for image in images)
            decoded = self.transform.collate([images[row] for row in cpu_rows], length) if cpu_rows else None
        else:
            decoded = torch.stack([images[row] for row in cpu_rows]) if cpu_rows else None
        return self.jpeg_batch(data, boxes, cpu_rows, decoded)

    def jpeg_batch(self, data: EncodedImages, boxes: torch.Tensor, cpu_rows: list | None = None,
                   decoded: torch.Tensor | None = None) -> JpegBatch:
        """A ``JpegBatch`` of this decoder's crop size and interpolation; a NaFlex tower's: of its patch size, packed
        to the longest row's sequence length."""
        if self.naflex:
            length = int(boxes[:, -1].max()) if decoded is None else decoded.shape[1]  # (the CPU rows' are zeros)
            return JpegBatch(data, boxes, cpu_rows or [], decoded, (length, self.transform.patch_size),
                             self.transform.interpolation, naflex=True)
        return JpegBatch(data, boxes, cpu_rows or [], decoded, tuple(self.transform.size),
                         self.transform.interpolation.value)

    def again(self, raw: EncodedImages) -> torch.Tensor | JpegBatch:
        """A kept sub-batch's encoded images made into images again: what the first pass made of
        them (the GPU path: the same boxes and rows, for the GPU to decode again)."""
        items = [self(self.decode(data), position) for data, position in raw]
        return self.collate(items, raw)
