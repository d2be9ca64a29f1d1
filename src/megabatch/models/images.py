"""Image normalisation shared by the data pipeline and the model (below both in the package graph).

Training images travel as uint8 and are normalised on the model's device (``normalize_images``);
evaluation transforms (open_clip's) normalise on the host with the same values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# OpenAI CLIP's normalisation constants: the default (a model's own preprocessing says otherwise).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def normalize_images(images: torch.Tensor, mean: Sequence[float] = CLIP_MEAN,
                     std: Sequence[float] = CLIP_STD) -> torch.Tensor:
    """uint8 ``[n, 3, s, s]`` -> float, scaled and normalised with the model's ``mean`` and ``std``
    (the same arithmetic as ``ToTensor`` + ``Normalize``); float input is returned unchanged."""
    if images.dtype != torch.uint8:
        return images
    if torch.compiler.is_compiling():  # constants of the compiled graph
        mean = torch.tensor(mean, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(std, device=images.device).view(1, 3, 1, 1)
    else:  # made once per device: a copy from the host at every call waited for the GPU (a host sync a forward)
        mean, std = channel_constants(tuple(mean), images.device), channel_constants(tuple(std), images.device)
    return (images.float().div(255) - mean) / std


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def channel_constants(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a ``[1, 3, 1, 1]`` float tensor on ``device``, made on first use and kept."""
    key = (values, device)
    held = _CONSTANTS.get(key)
    if held is None:
        held = _CONSTANTS[key] = torch.tensor(values, device=device).view(1, 3, 1, 1)
    return held
