"""Image normalisation shared by the data pipeline and the model (below both in the package graph).

Training images travel as uint8 and are normalised on the model's device (``normalize_images``);
evaluation transforms normalise on the host with the same constants.
"""

from __future__ import annotations

import torch

# OpenAI CLIP's normalisation constants (open_clip uses the same for its ViTs).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 3, s, s]`` -> float, scaled and normalised with CLIP's constants (the same
    arithmetic as ``ToTensor`` + ``Normalize``); float input is returned unchanged."""
    if images.dtype != torch.uint8:
        return images
    mean = torch.tensor(CLIP_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float().div(255) - mean) / std
