"""Image transforms for training and evaluation (torchvision), with per-sample seeded randomness."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision import transforms as T
from torchvision.transforms import v2 as T2

from ..images import CLIP_MEAN, CLIP_STD


def train_transform(
    image_size: int, scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (0.75, 4 / 3)
) -> T2.RandomResizedCrop:
    """RandomResizedCrop (Inf-CL paper defaults: scale 0.08-1.0, ratio 0.75-1.33, bicubic with
    antialiasing) of a uint8 RGB ``[3, h, w]`` tensor (``samples.decode_rgb``) to uint8
    ``[3, s, s]``: the crop is cut before resizing, so only the crop's pixels are interpolated.
    Normalisation happens on the model's device (``images.normalize_images``): uint8 moves 4x fewer bytes
    from the loader workers and to the GPU than float32."""
    # transforms.v2 resizes uint8 directly (v1 converts to float first: 3x slower per sample)
    return T2.RandomResizedCrop(image_size, scale=tuple(scale), ratio=tuple(ratio),
                                interpolation=T2.InterpolationMode.BICUBIC, antialias=True)


def eval_transform(image_size: int) -> T.Compose:
    """Resize the short side to ``image_size``, centre crop, normalise."""
    return T.Compose(
        [
            T.Lambda(lambda image: image.convert("RGB")),
            T.Resize(image_size, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(image_size),
            T.ToTensor(),
            T.Normalize(CLIP_MEAN, CLIP_STD),
        ]
    )


def seeded(transform, image, seed: int) -> torch.Tensor:
    """Apply ``transform`` with torch's CPU RNG seeded by ``seed`` and restored afterwards.

    The augmentation of a sample then depends only on (run seed, epoch, sample position), not on
    which loader worker decoded it or what else drew random numbers: resuming mid-epoch and
    re-decoding a sample reproduce it exactly.
    """
    generator = torch.default_generator  # the CPU generator the transforms draw from
    state = generator.get_state()
    # (not torch.manual_seed: it also queues a lazy CUDA seed, recording a stack trace each call,
    # which cost a fifth of a loader worker's time per sample)
    generator.manual_seed(seed)
    try:
        return transform(image)
    finally:
        generator.set_state(state)
