"""The one description both model builders take: ``ModelSpec``, the ``model`` group's keys less its run settings
(``ModelSettings``: compile, attention, ...). ``build_clip`` (the built-in shapes, Hugging Face text towers, a CoCa's
decoder) and ``build_openclip`` (any open_clip architecture by ``arch``) read the same fields; each refuses, naming
the key, the fields that are the other's."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..config import ConfigError, no_such_option

OPENAI_LOGIT_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature, build_clip's default


@dataclass(frozen=True)
class ModelSpec:
    """A CLIP model's description. ``name``: the model's name (``None``: the architecture's); ``embed_dim``: the
    shared embedding width; ``image`` / ``text``: the towers' fields (open_clip's ``CLIPVisionCfg`` /
    ``CLIPTextCfg``, or with ``arch`` overrides of the architecture's, plus ``unlocked_layers``, ``ckpt``,
    ``hf_path``, ``pooling``, ``proj``); ``quick_gelu``, ``init_logit_scale``, ``init_logit_bias`` (``None``: the
    builder's or the architecture's); ``pretrained``: local weights of the whole model; ``preprocess``:
    ``model.preprocess.*``; ``grad_checkpointing``; ``lock_image`` / ``lock_text`` (LiT); ``arch``: an open_clip
    architecture (``build_openclip``'s); ``multimodal``: a CoCa's decoder (``build_clip``'s); ``decoder``: a caption
    decoder over the image tower's tokens for any CLIP (``models/decoder.py``, both builders')."""

    name: str | None = None
    embed_dim: int | None = None
    image: Mapping[str, Any] = field(default_factory=dict)
    text: Mapping[str, Any] = field(default_factory=dict)
    quick_gelu: bool | None = None
    init_logit_scale: float | None = None
    init_logit_bias: float | None = None
    pretrained: str | None = None
    preprocess: Mapping[str, Any] | None = None
    grad_checkpointing: bool = False
    lock_image: bool = False
    lock_text: bool = False
    arch: str | None = None
    multimodal: Mapping[str, Any] | None = None
    decoder: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, values: Mapping[str, Any], builder: str, refused: Mapping[str, str] = {}) -> ModelSpec:
        """The spec of a builder's keyword arguments (the ``model`` config's keys): an unknown key, or one of
        ``refused`` (key -> the fix), is a ``ConfigError`` naming ``model.<key>``."""
        known = [spec.name for spec in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{no_such_option(f'model.{unknown[0]}', known)} ({builder})")
        for key, fix in refused.items():
            if values.get(key) is not None:
                raise ConfigError(f"model.{key}={values[key]!r} is not {builder}'s: {fix}")
        return cls(**{key: ({} if value is None and key in ("image", "text") else value)
                      for key, value in values.items()})
