"""Any open_clip architecture by name (``model=openclip model.arch=ViT-B-32``), built by
``open_clip.create_model``, with local pretrained weights and the preprocessing that goes with them;
and the rebuild of a model from its description (checkpoints, exports).
"""

from __future__ import annotations

import difflib
import logging
from copy import deepcopy
from typing import Any

import open_clip
from open_clip.model import CLIP, CustomTextCLIP, set_model_preprocess_cfg

from ..config import ConfigError
from .clip import (
    PLACEHOLDER_VISION,
    ClipModel,
    attach_decoder,
    attach_views,
    init_caption_decoder,
    lock_towers,
    use_naflex_tower,
)
from .export import DECODER_NAME
from .naflex import NaFlexCfg
from .preprocess import describe_preprocess, resolve_preprocess
from .pretrained import Pretrained, load_weights, read_state_dict, resolve_pretrained
from .spec import ModelSpec

log = logging.getLogger(__name__)

PREPROCESS_FIELDS = ("mean", "std", "interpolation", "resize_mode")
# model.image keys of an open_clip architecture's NaFlex tower (NaFlexCfg's, beside open_clip's vision_cfg fields)
NAFLEX_OVERRIDES = ("max_seq_len", "ls_init_value")


def build_openclip(**values: Any) -> ClipModel:
    """An open_clip architecture (``arch``, a name of ``open_clip.list_models()``; or null to take it
    from the ``open_clip_config.json`` of a ``pretrained`` folder), with weights from ``pretrained``
    (a local file or folder, ``pretrained.resolve_pretrained``) or random.

    ``image`` / ``text`` override fields of the architecture's ``vision_cfg`` / ``text_cfg`` (plus
    ``unlocked_layers``, with ``lock_*``); ``embed_dim``, ``quick_gelu``, ``init_logit_scale`` and
    ``init_logit_bias`` override the architecture's when not null. ``preprocess``: non-null values
    win over the pretrained folder's and the architecture's pretrained tags' preprocessing. The keywords are
    ``ModelSpec``'s (``models/spec.py``, the type ``build_clip`` takes too).
    """
    spec = ModelSpec.of(values, "build_openclip", refused={
        "multimodal": "an open_clip CoCa architecture brings its decoder (model.arch=coca_ViT-B-32); model=tiny_coca "
                      "builds one from model.multimodal"})
    arch, pretrained, name, embed_dim = spec.arch, spec.pretrained, spec.name, spec.embed_dim
    image, text, quick_gelu = spec.image, spec.text, spec.quick_gelu
    init_logit_scale, init_logit_bias, preprocess = spec.init_logit_scale, spec.init_logit_bias, spec.preprocess
    grad_checkpointing, lock_image, lock_text = spec.grad_checkpointing, spec.lock_image, spec.lock_text
    source = resolve_pretrained(pretrained)
    if arch is None and (source is None or source.config is None):
        raise ConfigError("model.arch is not set: name an open_clip architecture (e.g. model.arch=ViT-B-32; "
                          "python -c 'import open_clip; print(open_clip.list_models())' lists them), or give "
                          "model.pretrained a folder holding open_clip_config.json")
    model_cfg = architecture_config(arch, source)
    image, text = dict(image or {}), dict(text or {})
    image_unlocked = int(image.pop("unlocked_layers", 0) or 0)
    text_unlocked = int(text.pop("unlocked_layers", 0) or 0)
    naflex_keys = {key: image.pop(key) for key in NAFLEX_OVERRIDES if key in image}
    model_cfg["vision_cfg"].update(image)
    model_cfg["text_cfg"].update(text)
    # a timm naflexvit_* tower (OpenCLIP's NaFlex configs): megabatch's NaFlex tower of the same weights, fed packed
    # patches (models/naflex.py); built with the smallest open_clip ViT, then put in
    naflex = NaFlexCfg.of_open_clip(model_cfg["vision_cfg"], naflex_keys)
    if naflex_keys and naflex is None:
        raise ConfigError(f"model.image.{next(iter(naflex_keys))} is a NaFlex tower's key, and model.arch="
                          f"{arch}'s image tower is not one (its vision_cfg names no timm naflexvit_* model)")
    if naflex is not None:
        model_cfg["vision_cfg"] = dict(PLACEHOLDER_VISION)
    # tower weights come from model.pretrained (or start random): never from a hub
    if "timm_model_name" in model_cfg["vision_cfg"] and "timm_model_pretrained" not in image:
        model_cfg["vision_cfg"]["timm_model_pretrained"] = False
    if "hf_model_name" in model_cfg["text_cfg"] and "hf_model_pretrained" not in text:
        model_cfg["text_cfg"]["hf_model_pretrained"] = False
    for key, value in (("embed_dim", embed_dim), ("quick_gelu", quick_gelu), ("init_logit_bias", init_logit_bias)):
        if value is not None:
            model_cfg[key] = value
    label = f"model.arch={arch}" if arch else f"the architecture of {source.folder}/open_clip_config.json"
    kwargs = {"init_logit_scale": init_logit_scale} if init_logit_scale is not None else {}
    clip = _create(model_cfg, label, **kwargs)
    if naflex is not None:
        use_naflex_tower(clip, model_cfg, naflex)
    if source is not None:
        hint = ("; the folder's open_clip_config.json describes its own architecture: model.arch=null builds that"
                if arch and source.config else "")
        load_weights(clip, source.weights, "model.pretrained", label, hint=hint)
    preprocess_cfg = resolve_preprocess(default_preprocess(arch, source), preprocess or {},
                                        clip.visual.image_size, "model.preprocess")
    set_model_preprocess_cfg(clip, preprocess_cfg)
    if grad_checkpointing:
        clip.set_grad_checkpointing(True)
    _freeze_caption_decoder(clip)
    model = ClipModel(clip, name or arch or source.folder.name, model_cfg, arch,
                      str(source.folder) if source is not None and source.has_tokenizer else None)
    attach_decoder(model, spec.decoder)
    if source is not None and source.folder is not None and (source.folder / DECODER_NAME).is_file():
        # an export that kept model.decoder (scripts/export.py decoder=true): it comes back with its weights
        if model.decoder is None:
            attach_decoder(model, (source.config or {}).get("megabatch_decoder"))
        try:
            model.decoder.load_state_dict(read_state_dict(source.folder / DECODER_NAME))
        except RuntimeError as error:
            raise ConfigError(f"model.pretrained={str(source.folder)!r}: its {DECODER_NAME} does not fit "
                              f"model.decoder={model.decoder.cfg.to_dict()} ({str(error).splitlines()[0]}); "
                              "leave model.decoder.layers=0 to build the folder's own") from None
    log.info("model %s (%s): %.1fM parameters; preprocessing %s", model.name, label,
             sum(p.numel() for p in clip.parameters()) / 1e6, describe_preprocess(preprocess_cfg))
    lock_towers(model, lock_image, lock_text, image_unlocked, text_unlocked,
                image_pretrained=source is not None, text_pretrained=source is not None)
    return model


def architecture_config(arch: str | None, source: Pretrained | None) -> dict[str, Any]:
    """open_clip's model config of ``arch`` (a built-in name), else of the pretrained folder."""
    if arch is None:
        return deepcopy(source.config["model_cfg"])
    model_cfg = open_clip.get_model_config(str(arch).replace("/", "-"))
    if model_cfg is None:
        close = difflib.get_close_matches(str(arch), open_clip.list_models(), n=4, cutoff=0.5)
        raise ConfigError(f"model.arch={arch!r} is not an open_clip architecture"
                          f"{'; did you mean ' + ', '.join(close) + '?' if close else ''} "
                          "(open_clip.list_models() lists them)")
    return model_cfg


def default_preprocess(arch: str | None, source: Pretrained | None) -> dict[str, Any]:
    """The preprocessing the weights were trained with: the pretrained folder's ``preprocess_cfg``;
    else, for a built-in architecture, the values all of open_clip's pretrained tags of it agree on
    (SigLIP's mean/std 0.5 and squash resizing, ...); else open_clip's defaults (OpenAI CLIP's)."""
    if source is not None and source.config is not None and source.config.get("preprocess_cfg"):
        return dict(source.config["preprocess_cfg"])
    if not arch:
        return {}
    tags = [open_clip.get_pretrained_cfg(arch, tag) for tag in open_clip.list_pretrained_tags_by_model(arch)]
    agreed = {}
    for field in PREPROCESS_FIELDS:
        values = {repr(tuple(t[field]) if isinstance(t[field], (list, tuple)) else t[field])
                  for t in tags if field in t}
        if len(values) == 1:
            agreed[field] = next(t[field] for t in tags if field in t)
    return agreed


def _create(model_cfg: dict[str, Any], label: str, **kwargs) -> CLIP | CustomTextCLIP:
    """The model class open_clip would build for ``model_cfg`` (CLIP, CustomTextCLIP, CoCa), random."""
    cfg = deepcopy(model_cfg)
    custom_text = cfg.pop("custom_text", False) or "hf_model_name" in cfg["text_cfg"]
    cls = open_clip.CoCa if "multimodal_cfg" in cfg else CustomTextCLIP if custom_text else CLIP
    try:
        return init_caption_decoder(cls(**cfg, **kwargs))
    except TypeError as error:  # an override that the tower's config has no field for
        raise ConfigError(f"{label}: {error} (check model.image.* / model.text.* against open_clip's "
                          "CLIPVisionCfg / CLIPTextCfg fields)") from None
    except OSError as error:  # transformers: an HF text tower's config is not on disk
        raise ConfigError(f"{label}: {str(error).splitlines()[0][:200]}; a Hugging Face text tower's config is "
                          "read from local files only: set model.text.hf_model_name=<a local model folder>") from None


def _freeze_caption_decoder(clip) -> None:
    """CoCa: its captioning decoder takes no part in a contrastive loss; frozen, so that DDP and the
    optimizer see only what the loss trains (``loss.caption_weight > 0`` unfreezes it: train/build/parts.py)."""
    decoder = getattr(clip, "text_decoder", None)
    if decoder is not None:
        decoder.requires_grad_(False)
        log.info("CoCa: the captioning decoder (text_decoder) is frozen unless loss.caption_weight > 0 trains it")


def from_description(description: dict[str, Any]) -> ClipModel:
    """A model with random weights, built from ``ClipModel.description()`` (a checkpoint's, an
    export's): no config group, no pretrained file needed; load the weights afterwards."""
    model_cfg = deepcopy(description["model_cfg"])
    naflex = description.get("naflex")
    if naflex is not None:  # built with the smallest open_clip ViT, then its NaFlex tower put in (models/naflex.py)
        model_cfg["vision_cfg"] = dict(PLACEHOLDER_VISION)
    if "timm_model_name" in model_cfg["vision_cfg"]:
        model_cfg["vision_cfg"]["timm_model_pretrained"] = False
    if "hf_model_name" in model_cfg["text_cfg"]:
        model_cfg["text_cfg"]["hf_model_pretrained"] = False  # the weights follow
    clip = _create(model_cfg, f"the stored model {description['name']}")
    if naflex is not None:
        use_naflex_tower(clip, model_cfg, NaFlexCfg.of(naflex))
    set_model_preprocess_cfg(clip, dict(description["preprocess_cfg"]))
    _freeze_caption_decoder(clip)
    model = ClipModel(clip, description["name"], description["model_cfg"], description.get("arch"),
                      description.get("tokenizer_folder"))
    attach_decoder(model, description.get("decoder"))
    attach_views(model, description.get("views"))
    return model
