"""Image transforms for training and evaluation (torchvision), with per-sample seeded randomness."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torchvision.transforms import v2 as T2
from torchvision.transforms.v2 import functional as TF


def train_transform(
    image_size: int | Sequence[int], interpolation: str = "bicubic", scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (0.75, 4 / 3),
) -> T2.RandomResizedCrop:
    """RandomResizedCrop (Inf-CL paper defaults: scale 0.08-1.0, ratio 0.75-1.33, with antialiasing;
    ``interpolation`` is the model's, ``preprocess.interpolation``) of a uint8 RGB ``[3, h, w]``
    tensor (``samples.decode_rgb``) to uint8 ``[3, s, s]``: the crop is cut before resizing, so only
    the crop's pixels are interpolated. Normalisation, with the model's mean and std, happens on the
    model's device (``ClipModel.encode_image``): uint8 moves 4x fewer bytes from the loader workers
    and to the GPU than float32."""
    # transforms.v2 resizes uint8 directly (v1 converts to float first: 3x slower per sample)
    size = image_size if isinstance(image_size, int) else list(image_size)
    return T2.RandomResizedCrop(size, scale=tuple(scale), ratio=tuple(ratio),
                                interpolation=T2.InterpolationMode(interpolation), antialias=True)


def eval_transform(preprocess: dict[str, Any]) -> Callable:
    """open_clip's own evaluation transform for the model's preprocessing (``ClipModel.preprocess``:
    resize by ``resize_mode`` with its ``interpolation``, centre crop, RGB, normalise with its mean
    and std): evaluated images are what open_clip and CLIP_benchmark feed the same model."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in preprocess.items()}
    return image_transform_v2(PreprocessCfg(**fields), is_train=False)


def crop_box(transform: T2.RandomResizedCrop, height: int, width: int, seed: int) -> tuple[int, int, int, int]:
    """The crop ``(top, left, height, width)`` that ``transform`` cuts from an image of ``height x
    width`` when torch's CPU generator is seeded with ``seed``, without the pixels. The draws are
    torchvision's (``RandomResizedCrop.make_params``: the same calls, dtypes and order; a test holds
    them equal) made on a private generator seeded alike, so a thread may draw boxes while another
    uses the global generator (GradCache's replay restores and draws from it). The CPU path
    (``resized_crop``) and the GPU path (``data/gpu_decode.py``) both cut this box."""
    generator = torch.Generator().manual_seed(seed)  # the same stream as the global one seeded so
    scale, ratio = transform.scale, transform.ratio
    log_ratio = torch.log(torch.tensor(ratio))
    area = height * width
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = width / height  # ten misses: the central crop, clamped to the ratio range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop(transform: T2.RandomResizedCrop, image: torch.Tensor,
                 box: tuple[int, int, int, int]) -> torch.Tensor:
    """``transform``'s crop of ``box`` from ``image``, resized as the transform does (what
    ``transform(image)`` gives when it draws ``box``)."""
    return TF.resized_crop(image, *box, size=list(transform.size), interpolation=transform.interpolation,
                           antialias=transform.antialias)


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
