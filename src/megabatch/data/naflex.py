"""NaFlex images (``model.image.naflex``): each image resized with its aspect ratio kept to at most a sequence
length's patches (timm's ``get_image_size_for_seq``), cut into patches (timm's ``patchify_image``), and a
sub-batch's images packed into one uint8 tensor ``[n, L, 3 p^2 + 4]`` (``kernels/packed_patches.py``'s layout,
which the tower unpacks on the device).

Each image's sequence length is drawn from ``data.naflex.seq_lens`` with a seed of its position's global batch
(``position // group``, ``NaFlexSpec.seq_len``): a function of the sample alone, as its augmentation is, so any
cut into sub-batches, any rank count and the offload's decoding again give the same patches (exact), and with the
indexed and position splits, whose positions are the batch's, every image of a step has the same length. A
sub-batch is packed to its longest image's length (one of ``seq_lens``: one compiled graph each); the padding
rows are masked out of attention and pooling.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from ..kernels.packed_patches import pack, row_bytes


class UnusableImage(ValueError):
    """An image a NaFlex tower cannot take as it is (a side shorter than one patch, an aspect ratio beyond
    ``data.naflex.max_aspect``): the sample is skipped and counted (``bad_shape``)."""


@dataclass(frozen=True)
class NaFlexSpec:
    """What the data path needs to make a NaFlex tower's input: the model's ``patch_size`` and ``max_seq_len``,
    ``data.naflex``'s ``seq_lens`` (drawn per ``group`` of positions: the global batch) and ``max_aspect``, and the
    resize's ``interpolation``."""

    patch_size: int
    max_seq_len: int
    seq_lens: tuple[int, ...]
    max_aspect: float = 20.0
    interpolation: str = "bicubic"
    group: int = 1
    scale: tuple[float, float] = (1.0, 1.0)  # data.train.augment's: the crop's share of the image's area
    ratio: tuple[float, float] = (1.0, 1.0)  # and its aspect ratio's factor on the image's own (1: the image's)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.patch_size)

    def seq_len(self, seed: int, epoch: int, position: int) -> int:
        """The sequence length of the sample at ``position`` of ``epoch``'s stream: one of ``seq_lens``, drawn
        for its group of positions (its global batch)."""
        if len(self.seq_lens) == 1:
            return self.seq_lens[0]
        return random.Random((seed * 1_000_003 + epoch) * 10_000_019 + position // self.group).choice(self.seq_lens)

    def check(self, image: torch.Tensor) -> torch.Tensor:
        """``image`` (uint8 ``[3, h, w]``) if a NaFlex tower can take it, else ``UnusableImage`` saying why."""
        self.check_size(*image.shape[-2:])
        return image

    def check_size(self, height: int, width: int) -> None:
        """``UnusableImage`` for an image of ``height x width`` a NaFlex tower cannot take (read from the pixels, or
        from a JPEG's header where the GPU decodes it)."""
        if min(height, width) < self.patch_size:
            raise UnusableImage(f"{height} x {width} px: a side shorter than one {self.patch_size} px patch")
        if max(height, width) > self.max_aspect * min(height, width):
            raise UnusableImage(f"{height} x {width} px: an aspect ratio beyond data.naflex.max_aspect="
                                f"{self.max_aspect:g}")

    def target_size(self, height: int, width: int, seq_len: int) -> tuple[int, int]:
        """The size, multiples of the patch, an image of ``height x width`` is resized to: its aspect ratio
        kept, as many patches as fit in ``seq_len`` (timm's search; up- or downsampled)."""
        from timm.data.naflex_transforms import get_image_size_for_seq

        return tuple(get_image_size_for_seq((height, width), self.patch_size, seq_len)[1])

    def crop(self, image: torch.Tensor, seed: int) -> torch.Tensor:
        """``image``'s random crop for training (``crop_box``); ``image`` itself where no crop is set."""
        if self.scale == (1.0, 1.0) and self.ratio == (1.0, 1.0):
            return image
        top, left, height, width = self.crop_box(image.shape[-2], image.shape[-1], seed)
        return image[..., top:top + height, left:left + width]

    def crop_box(self, height: int, width: int, seed: int) -> tuple[int, int, int, int]:
        """The training crop ``(top, left, height, width)`` of an image of ``height x width``, drawn from ``seed``
        (the sample's: the same crop again in the offload's replay, and on the GPU from the JPEG's header): a
        share in ``scale`` of its area, its aspect ratio the image's times a factor drawn log-uniformly in
        ``ratio`` (the fixed-size path's ``RandomResizedCrop`` ranges, relative to the image's own aspect ratio,
        which the NaFlex tower keeps), clamped to the image, at a random place."""
        if self.scale == (1.0, 1.0) and self.ratio == (1.0, 1.0):
            return 0, 0, height, width
        draw = random.Random(seed)
        area = height * width * draw.uniform(*self.scale)
        aspect = width / height * math.exp(draw.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
        crop_w = min(width, max(1, round(math.sqrt(area * aspect))))
        crop_h = min(height, max(1, round(math.sqrt(area / aspect))))
        top, left = draw.randint(0, height - crop_h), draw.randint(0, width - crop_w)
        return top, left, crop_h, crop_w

    def gpu_row(self, height: int, width: int, hardware: bool, seq_len: int, seed: int) -> tuple[int, ...]:
        """``data.decode=gpu``: what the GPU needs to make the patches ``patches`` makes of a JPEG of ``height x
        width`` (its header): a ``JpegBatch.boxes`` row, the crop box, the header (size, whether nvJPEG's
        hardware takes it), the size the crop is resized to and the sequence length it is packed to."""
        box = self.crop_box(height, width, seed)
        return (*box, height, width, int(hardware), *self.target_size(box[2], box[3], seq_len), seq_len)

    def patches(self, image: torch.Tensor, seq_len: int, seed: int | None = None) -> torch.Tensor:
        """uint8 ``[seq_len, row_bytes]``: ``image`` (uint8 ``[3, h, w]``; with ``seed``, its training ``crop``)
        resized to ``target_size``, its patches with their coordinates, then padding rows."""
        from timm.data.naflex_transforms import patchify_image

        if seed is not None:
            image = self.crop(image, seed)
        size = self.target_size(image.shape[-2], image.shape[-1], seq_len)
        if tuple(image.shape[-2:]) != size:
            image = TF.resize(image, list(size), interpolation=InterpolationMode(self.interpolation),
                              antialias=True)
        pixels, coord, _ = patchify_image(image, (self.patch_size, self.patch_size))
        return pack(pixels, coord, seq_len)

    def eval_transform(self, seq_len: int | None = None) -> NaFlexEval:
        """Evaluation's transform: a PIL image to its patches at ``seq_len`` (``max_seq_len`` where ``None``), its
        aspect ratio kept, padded to ``seq_len`` rows (a batch stacks them)."""
        seq_len = seq_len or self.max_seq_len
        return NaFlexEval(NaFlexSpec(self.patch_size, seq_len, (seq_len,), interpolation=self.interpolation))

    def collate(self, packed: list[torch.Tensor], length: int = 0) -> torch.Tensor:
        """A sub-batch's images (``patches``' rows, each of its own length) as one uint8 ``[n, L, row_bytes]``,
        ``L`` the longest's length (or ``length``, if longer: a sub-batch whose other rows the GPU packs): the others
        padded with zero rows."""
        length = max(length, *(item.shape[0] for item in packed))
        if all(item.shape[0] == length for item in packed):
            return torch.stack(packed)
        out = torch.zeros(len(packed), length, self.row_bytes, dtype=torch.uint8)
        for row, item in enumerate(packed):
            out[row, :item.shape[0]] = item
        return out


@dataclass(frozen=True)
class NaFlexEval:
    """A NaFlex tower's evaluation transform (``NaFlexSpec.eval_transform``): a PIL image (or uint8 ``[3, h, w]``)
    to uint8 ``[seq_len, row_bytes]``, every image kept whole (none skipped: a set is scored on all of it).
    Picklable: evaluation's loader workers take it."""

    spec: NaFlexSpec

    def __call__(self, image) -> torch.Tensor:
        if not isinstance(image, torch.Tensor):
            image = TF.pil_to_tensor(image.convert("RGB"))
        return self.spec.patches(image, self.spec.max_seq_len)
