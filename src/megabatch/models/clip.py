"""CLIP models built through open_clip from per-tower configs (``model.image.*``, ``model.text.*``).

Weights start random; pretrained weights come only from a local file (``model.pretrained``), never
from a hub.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import open_clip
import torch
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
from torch import nn

from ..config import ConfigError

log = logging.getLogger(__name__)

MAX_LOGIT_SCALE = math.log(100.0)


class ClipModel(nn.Module):
    """An open_clip ``CLIP`` returning L2-normalised features and the scale multiplier.

    ``forward(images [b, 3, s, s], texts [b, ctx])`` -> ``(image_features [b, e], text_features
    [b, e], scale [])`` with ``scale = logit_scale.exp()``. Both towers live in one module so that
    one DDP wrapper synchronises them together.
    """

    def __init__(self, clip: CLIP, name: str):
        super().__init__()
        self.clip = clip
        self.name = name

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.clip.encode_image(images), dim=-1)

    def encode_text(self, texts: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.clip.encode_text(texts), dim=-1)

    def forward(self, images: torch.Tensor, texts: torch.Tensor):
        return self.encode_image(images), self.encode_text(texts), self.clip.logit_scale.exp()

    @torch.no_grad()
    def clamp_logit_scale(self) -> None:
        """Keep the temperature in [0, log 100] (CLIP's clamp), after each optimizer step."""
        self.clip.logit_scale.clamp_(0, MAX_LOGIT_SCALE)


def _dataclass_kwargs(cls, values: dict[str, Any], key: str) -> dict[str, Any]:
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{key}: unknown option(s) {unknown}; open_clip's {cls.__name__} has {sorted(known)}")
    return values


def build_clip(
    name: str,
    embed_dim: int,
    image: dict[str, Any],
    text: dict[str, Any],
    quick_gelu: bool = False,
    init_logit_scale: float = math.log(1 / 0.07),
    pretrained: str | None = None,
    grad_checkpointing: bool = False,
) -> ClipModel:
    """Build a CLIP from tower configs.

    ``image``/``text`` hold open_clip's ``CLIPVisionCfg``/``CLIPTextCfg`` fields, plus our own
    ``image.ckpt`` (a local image-tower state dict) and ``text.tokenizer`` (unused here).
    ``pretrained`` is a local open_clip checkpoint of the whole model.
    """
    image = dict(image)
    text = dict(text)
    image_ckpt = image.pop("ckpt", None)
    text.pop("tokenizer", None)
    clip = CLIP(
        embed_dim=embed_dim,
        vision_cfg=CLIPVisionCfg(**_dataclass_kwargs(CLIPVisionCfg, image, "model.image")),
        text_cfg=CLIPTextCfg(**_dataclass_kwargs(CLIPTextCfg, text, "model.text")),
        quick_gelu=quick_gelu,
        init_logit_scale=init_logit_scale,
    )
    if pretrained:
        _load_local(clip, pretrained, "model.pretrained", prefix="")
    if image_ckpt:
        _load_local(clip.visual, image_ckpt, "model.image.ckpt", prefix="visual.")
    if grad_checkpointing:
        clip.set_grad_checkpointing(True)
    return ClipModel(clip, name)


def _load_local(module: nn.Module, path: str, key: str, prefix: str) -> None:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path!r} is not a file; pretrained weights load only from local paths")
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state.get("model", state))
    state = {k.removeprefix("module.").removeprefix("clip."): v for k, v in state.items()}
    if prefix and any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{key}={path!r} does not match the configured model: missing {missing[:5]}..., "
            f"unexpected {unexpected[:5]}... (check model.image / model.text sizes)"
        )
    log.info("loaded %s from %s", key, path)


def build_tokenizer(context_length: int = 77, **_: Any):
    """open_clip's CLIP BPE tokenizer (the vocabulary ships inside the package)."""
    return open_clip.tokenizer.SimpleTokenizer(context_length=context_length)
