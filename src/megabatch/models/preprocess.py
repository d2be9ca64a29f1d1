"""The preprocessing and the tokenizer that go with a model: open_clip's ``PreprocessCfg`` (resolved
from defaults, a pretrained config and ``model.preprocess.*``) and its tokenizers, built from local
files only."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from open_clip.transform import PreprocessCfg

from ..config import ConfigError
from ..config.schema import INTERPOLATIONS, PREPROCESS_KEYS, RESIZE_MODES

log = logging.getLogger(__name__)


def resolve_preprocess(base: dict[str, Any], overrides: dict[str, Any], size, key: str) -> dict[str, Any]:
    """open_clip's defaults (OpenAI CLIP mean/std, bicubic, shortest-side resize), then ``base`` (a
    pretrained config's ``preprocess_cfg``), then the non-null ``overrides`` (``model.preprocess.*``);
    ``size`` is the model's image size, whatever the configs say. Checked, with errors naming ``key``."""
    unknown = sorted(set(overrides) - set(PREPROCESS_KEYS))
    if unknown:
        raise ConfigError(f"{key}: unknown option(s) {unknown}; the options are {', '.join(PREPROCESS_KEYS)} "
                          "(the image size is the model's: model.image.image_size)")
    cfg = asdict(PreprocessCfg())
    cfg.update({k: v for k, v in base.items() if k in PREPROCESS_KEYS})
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    cfg["size"] = size if isinstance(size, int) else list(size) if size[0] != size[1] else int(size[0])
    for name in ("mean", "std"):
        values = cfg[name]
        if isinstance(values, (int, float)):
            values = [values] * 3
        if len(values) != 3 or not all(isinstance(v, (int, float)) for v in values) or (
                name == "std" and min(values) <= 0):
            raise ConfigError(f"{key}.{name}={list(values)}: give three numbers (R, G, B)"
                              f"{', each > 0' if name == 'std' else ''}, e.g. [0.5, 0.5, 0.5]")
        cfg[name] = [float(v) for v in values]
    if cfg["interpolation"] not in INTERPOLATIONS:
        raise ConfigError(f"{key}.interpolation={cfg['interpolation']!r}; use one of {', '.join(INTERPOLATIONS)}")
    if cfg["resize_mode"] not in RESIZE_MODES:
        raise ConfigError(f"{key}.resize_mode={cfg['resize_mode']!r}; use one of {', '.join(RESIZE_MODES)}")
    return cfg


def describe_preprocess(cfg: dict[str, Any]) -> str:
    """One line for the run's log."""
    return (f"size {cfg['size']}, mean {[round(v, 4) for v in cfg['mean']]}, std {[round(v, 4) for v in cfg['std']]}, "
            f"{cfg['interpolation']}, resize {cfg['resize_mode']}")


def build_tokenizer(model_cfg: dict[str, Any], arch: str | None = None, folder: str | None = None):
    """The tokenizer of a model with open_clip config ``model_cfg``: a Hugging Face tokenizer
    (``text_cfg.hf_tokenizer_name``, read from ``folder`` when a pretrained folder holds it),
    SigLIP's for open_clip's SigLIP architectures, else CLIP's BPE tokenizer (shipped with
    open_clip). Only local files: a tokenizer that is not on disk is a ``ConfigError``."""
    import open_clip

    text = model_cfg["text_cfg"]
    context_length = int(text.get("context_length", 77))
    kwargs = dict(text.get("tokenizer_kwargs", {}))
    hf_name = text.get("hf_tokenizer_name")
    try:
        if hf_name:
            return open_clip.tokenizer.HFTokenizer(str(folder or hf_name), context_length=context_length,
                                                   tokenizer_mode=text.get("tokenizer_mode"), **kwargs)
        if arch and "siglip" in arch.lower():
            return open_clip.get_tokenizer(arch, context_length=context_length)
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, HTTP errors
        name = folder or hf_name or arch
        raise ConfigError(f"the tokenizer {name!r} of this model cannot be loaded from local files "
                          f"({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0][:160] if str(error).strip() else ''}); give "
                          "model.pretrained a folder that holds it (open_clip saves it beside the weights), or "
                          "+model.text.hf_tokenizer_name=<a local tokenizer folder>") from None
    return open_clip.tokenizer.SimpleTokenizer(context_length=context_length, **kwargs)
