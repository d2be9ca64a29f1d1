"""Export a model in open_clip's own folder format: ``open_clip_model.safetensors`` and
``open_clip_config.json`` (``model_cfg`` + ``preprocess_cfg``), plus a Hugging Face text tower's
config and tokenizer where the model has one. ``open_clip.create_model_and_transforms('local-dir:<out>')``
and ``open_clip.get_tokenizer('local-dir:<out>')`` load it unchanged; so does everything built on
them (CLIP_benchmark: ``--model local-dir:<out>``).
"""

from __future__ import annotations

import json
import logging
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from .clip import ClipModel
from .images import normalize_images
from .pretrained import CONFIG_NAME

log = logging.getLogger(__name__)

WEIGHTS_NAME = "open_clip_model.safetensors"
DECODER_NAME = "megabatch_decoder.safetensors"  # model.decoder's weights, where the export keeps them (decoder=true)


def export_open_clip(model: ClipModel, out: Path, extra: dict[str, Any] | None = None,
                     overwrite: bool = False, decoder: bool = False) -> Path:
    """Write ``model`` to the folder ``out`` (created); returns ``out``. ``extra`` is recorded
    under ``megabatch`` in the config (where it came from). An existing export is replaced only
    with ``overwrite``. ``decoder``: ``model.decoder``'s caption decoder kept beside the CLIP (``DECODER_NAME``, its
    keys under ``megabatch_decoder`` in the config; open_clip loads the folder without it, and
    ``model.pretrained=<folder>`` rebuilds it); a model without one is a ``ConfigError``."""
    from safetensors.torch import save_file

    out = Path(out).expanduser().resolve()
    if model.naflex is not None:
        from .naflex import why_not_open_clip

        why = why_not_open_clip(model.clip.visual)
        if why is not None:
            raise ConfigError(f"model {model.name}: {why}; megabatch evaluates and resumes its checkpoint as it is "
                              "(scripts/evaluate.py ckpt=...), but cannot export it as an open_clip folder: train "
                              "the variant at its own sizes to export")
    if decoder and model.decoder is None:
        raise ConfigError(f"decoder=true: model {model.name} has no model.decoder to keep (a CoCa's decoder is part "
                          "of the CLIP and always exported); use decoder=false")
    if (out / CONFIG_NAME).exists() and not overwrite:
        raise ConfigError(f"out={out} already holds an export ({CONFIG_NAME}); choose another folder or "
                          "pass overwrite=true")
    out.mkdir(parents=True, exist_ok=True)
    model_cfg = deepcopy(model.model_cfg)
    vision, text = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    if "timm_model_name" in vision:
        vision["timm_model_pretrained"] = False  # the weights are in the export
    if "hf_model_name" in text:  # the HF tower's config travels with the export, read from its folder
        model.clip.text.config.save_pretrained(out)
        text.update(hf_model_name=str(out), hf_model_pretrained=False)
    if "hf_tokenizer_name" in text:  # open_clip reads an HF tokenizer from the local-dir folder itself
        hf_tokenizer = getattr(model.tokenizer(), "tokenizer", None)
        if hf_tokenizer is None or not hasattr(hf_tokenizer, "save_pretrained"):
            raise ConfigError(f"model {model.name}: its Hugging Face tokenizer cannot be saved with the export")
        hf_tokenizer.save_pretrained(out)
        text["hf_tokenizer_name"] = str(out)
    config = {"model_cfg": model_cfg, "preprocess_cfg": model.description()["preprocess_cfg"]}
    if extra:
        config["megabatch"] = extra
    state = {name: tensor.detach().cpu().clone().contiguous() for name, tensor in model.clip.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    if decoder:
        tensors = {name: tensor.detach().cpu().clone().contiguous()
                   for name, tensor in model.decoder.state_dict().items()}
        save_file(tensors, str(out / DECODER_NAME), metadata={"format": "pt"})
        config["megabatch_decoder"] = model.decoder.cfg.to_dict()
    elif (out / DECODER_NAME).exists():  # an earlier export's, overwritten
        (out / DECODER_NAME).unlink()
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    log.info("exported %s (%d tensors) to %s", model.name, len(state), out)
    return out


@torch.no_grad()
def check_export(model: ClipModel, out: Path, samples: int = 4) -> float:
    """Load ``out`` with open_clip itself and return the largest relative difference between its
    image and text embeddings and ``model``'s, on random images (``samples``, in [0, 1] before
    normalisation) and real captions, in float32 on the CPU."""
    import open_clip

    theirs, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    tokenize = open_clip.get_tokenizer(f"local-dir:{out}")
    theirs.eval()
    ours = model.to("cpu").eval()
    size = ours.image_size if isinstance(ours.image_size, int) else ours.image_size[0]
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (samples, 3, size, size), generator=generator, dtype=torch.uint8)
    normalised = normalize_images(pixels, ours.preprocess["mean"], ours.preprocess["std"])  # open_clip's input
    captions = [f"a photo of the number {i}" for i in range(samples)]
    worst = 0.0
    for mine, other in (
        (ours.encode_image(pixels), theirs.encode_image(normalised, normalize=True)),
        (ours.encode_text(ours.tokenizer()(captions)), theirs.encode_text(tokenize(captions), normalize=True)),
    ):
        worst = max(worst, float((mine - other).norm() / other.norm()))
    return worst
