"""Pretrained weights from local paths only: a file (``.pt``/``.pth``/``.bin``/``.safetensors``,
open_clip's or megabatch's own checkpoints), an open_clip folder (``open_clip_config.json`` and
weights: what OpenCLIP's HF-hub models are), or such a folder inside the HF hub cache. Nothing is
downloaded.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError

log = logging.getLogger(__name__)

CONFIG_NAME = "open_clip_config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npz")
# the weights open_clip itself looks for in a folder, in its order of preference
PREFERRED_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                     "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth",
                     "model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model")


@dataclass(frozen=True)
class Pretrained:
    """Where pretrained weights are: the weights file, and the open_clip config (``model_cfg``,
    ``preprocess_cfg``) of the folder holding it, if it has one."""

    weights: Path
    folder: Path | None = None
    config: dict[str, Any] | None = None

    @property
    def has_tokenizer(self) -> bool:
        """The folder holds a Hugging Face tokenizer (open_clip saves it beside the weights)."""
        return self.folder is not None and any((self.folder / name).is_file() for name in TOKENIZER_FILES)


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache (``HF_HUB_CACHE``, ``HF_HOME``/hub, or ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"


def resolve_pretrained(value: str | None, key: str = "model.pretrained") -> Pretrained | None:
    """``value``: a weights file, an open_clip folder, an HF hub cache folder (``models--org--name``
    or one of its snapshots) or ``hf-hub:org/name`` (looked up in the local HF cache only)."""
    if value in (None, ""):
        return None
    text = str(value)
    if text.startswith("hf-hub:"):
        repo = text.removeprefix("hf-hub:").strip("/")
        path = hub_cache_dir() / ("models--" + repo.replace("/", "--"))
        if not path.is_dir():
            raise ConfigError(f"{key}={text!r}: {repo} is not in the local Hugging Face cache ({path} does not "
                              "exist) and nothing is downloaded; fetch it once elsewhere (huggingface-cli "
                              "download) or give the folder that holds open_clip_config.json")
    else:
        path = Path(text).expanduser()
    if path.is_file():
        if path.suffix not in WEIGHT_SUFFIXES:
            raise ConfigError(f"{key}={text!r}: not a weights file (use {', '.join(WEIGHT_SUFFIXES)}, or a "
                              f"folder holding {CONFIG_NAME})")
        folder = path.parent if (path.parent / CONFIG_NAME).is_file() else None
        return Pretrained(path, folder, _read_config(folder, key) if folder else None)
    if path.is_dir():
        folder = _config_folder(path, key)
        return Pretrained(_weights_in(folder, key), folder, _read_config(folder, key))
    raise ConfigError(f"{key}={text!r} is not a file or folder; pretrained weights load only from local paths: a "
                      f".pt/.bin/.safetensors file, a folder holding {CONFIG_NAME} and weights, or an HF hub "
                      f"cache folder (e.g. {hub_cache_dir()}/models--timm--ViT-B-32-...)")


def _config_folder(path: Path, key: str) -> Path:
    """``path`` itself, or the snapshot of an HF hub cache folder that ``refs/main`` names (else the
    newest snapshot holding an open_clip config)."""
    if (path / CONFIG_NAME).is_file():
        return path
    snapshots = path / "snapshots"
    if snapshots.is_dir():
        ref = path / "refs" / "main"
        if ref.is_file() and (snapshots / ref.read_text().strip() / CONFIG_NAME).is_file():
            return snapshots / ref.read_text().strip()
        found = sorted((s for s in snapshots.iterdir() if (s / CONFIG_NAME).is_file()),
                       key=lambda s: s.stat().st_mtime)
        if found:
            return found[-1]
    raise ConfigError(f"{key}={str(path)!r} is a folder without {CONFIG_NAME} (nor an HF hub cache folder "
                      "whose snapshot holds one); give the weights file itself, or a folder written by open_clip "
                      "or scripts/export.py")


def _weights_in(folder: Path, key: str) -> Path:
    for name in PREFERRED_WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    found = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not found:
        raise ConfigError(f"{key}={str(folder)!r} holds {CONFIG_NAME} but no weights "
                          f"({', '.join(PREFERRED_WEIGHTS[:3])}, ...)")
    return found[0]


def _read_config(folder: Path, key: str) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}: {folder / CONFIG_NAME} cannot be read: {error}") from None
    if "model_cfg" not in config:
        raise ConfigError(f"{key}: {folder / CONFIG_NAME} has no model_cfg (not an open_clip config)")
    return config


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A whole-model state dict from ``path`` with open_clip's key names: safetensors or a torch
    file holding a bare state dict, open_clip's training checkpoint (``state_dict``, ``module.``
    prefixes) or a megabatch checkpoint (``model``, ``clip.`` prefixes)."""
    from open_clip.factory import load_state_dict  # safetensors or torch; `state_dict` unwrapped, `module.` dropped

    try:
        state = load_state_dict(str(path))
    except Exception as error:  # noqa: BLE001 - truncated, pickled code, not torch, empty: many kinds
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{path} cannot be read as weights: {reason}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict) and "step" in state:
        state = state["model"]  # a megabatch checkpoint
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module.").removeprefix("clip."): v for k, v in state.items()}


# position embeddings whose length open_clip resizes to the model's image size and context length (their width
# must match)
RESIZED = ("positional_embedding", "visual.positional_embedding")


def mismatched_shapes(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor],
                      resized: tuple[str, ...] = RESIZED) -> list[str]:
    """``"name: file [a, b], model [c, d]"`` for each tensor of ``state`` whose shape differs from the model's
    (``own``), in the model's order; a position embedding of ``resized`` only where its width differs (its
    length is resized)."""
    misfits = []
    for name, tensor in own.items():
        theirs = state.get(name)
        if theirs is None or not hasattr(theirs, "shape") or theirs.shape == tensor.shape:
            continue
        if name in resized and theirs.dim() == tensor.dim() and theirs.shape[-1] == tensor.shape[-1]:
            continue
        misfits.append(f"{name}: file {list(theirs.shape)}, model {list(tensor.shape)}")
    return misfits


def text_tower_layout(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with open_clip's text tower named as the model names it (``own``): a ``CustomTextCLIP``'s tower
    under ``text.`` (what ``custom_text`` configs save: OpenCLIP's NaFlex models, SigLIP's) moved to a ``CLIP``'s
    top-level keys, or the reverse (open_clip's own conversion); ``state`` as it is where the layouts agree."""
    if "token_embedding.weight" in own and "text.token_embedding.weight" in state \
            and "token_embedding.weight" not in state:
        return {(k.removeprefix("text.") if k.startswith("text.") and k.removeprefix("text.") in own else k): v
                for k, v in state.items()}
    if "text.token_embedding.weight" in own and "token_embedding.weight" in state:
        from open_clip.model import convert_to_custom_text_state_dict

        return convert_to_custom_text_state_dict(state)
    return state


def load_weights(module: nn.Module, path: Path, key: str, architecture: str, prefix: str = "",
                 hint: str = "") -> None:
    """Load ``path`` into ``module`` (a whole open_clip model, or with ``prefix`` one tower of it).

    The learnable logit scale and bias come from the file; a bias the file lacks (a softmax-loss
    model fine-tuned with the sigmoid loss) keeps its initial value. Position embeddings are
    resized to the model's image size and context length, as open_clip does. Any other mismatch is
    a ``ConfigError`` naming the file and ``architecture`` (then ``hint``)."""
    from open_clip.model import resize_pos_embed, resize_text_pos_embed

    if path.suffix == ".npz":  # big_vision (SigLIP) numpy weights: open_clip converts them
        from open_clip.convert import load_big_vision_weights

        load_big_vision_weights(module, str(path))
        log.info("loaded %s from %s", key, path)
        return
    state = read_state_dict(path)
    if prefix and any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    own = module.state_dict()
    for name in ("logit_scale", "logit_bias"):
        if name in own and name in state and state[name].shape != own[name].shape:
            state[name] = state[name].reshape(own[name].shape)  # scalar vs [1]
    if "logit_bias" in own and "logit_bias" not in state:
        state["logit_bias"] = own["logit_bias"].clone()
        log.info("%s has no logit_bias: the model's initial %.2f is kept", path.name, float(own["logit_bias"]))
    state.pop("text.transformer.embeddings.position_ids", None)  # dropped by transformers >= 4.31
    state = text_tower_layout(state, own)
    misfits = mismatched_shapes(state, own)
    if misfits:  # before open_clip's resizing, which asserts on a width it cannot resize
        raise ConfigError(f"{key}={str(path)!r} does not fit {architecture}: {'; '.join(misfits[:3])}"
                          f"{f' (and {len(misfits) - 3} more)' if len(misfits) > 3 else ''}{hint}")
    if not prefix:
        resize_pos_embed(state, module)
        resize_text_pos_embed(state, module)
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as error:  # shapes differ
        shapes = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
        raise ConfigError(f"{key}={str(path)!r} does not fit {architecture}: {'; '.join(shapes[:3]) or error}"
                          f"{' ...' if len(shapes) > 3 else ''}{hint}") from None
    if missing or unexpected:
        raise ConfigError(f"{key}={str(path)!r} does not fit {architecture}: missing {sorted(missing)[:4]}"
                          f"{'...' if len(missing) > 4 else ''}, unexpected {sorted(unexpected)[:4]}"
                          f"{'...' if len(unexpected) > 4 else ''}{hint}")
    log.info("loaded %s from %s", key, path)
