"""A model rebuilt from a checkpoint: what evaluation, export, captioning and a checkpoint teacher load."""

from __future__ import annotations

from omegaconf import OmegaConf

from ..models import ClipModel, from_description
from ..models.clip import builder_node
from .files import build_stored, model_weights


def model_from_checkpoint(state: dict, weights: str = "raw", where: str = "weights") -> ClipModel:
    """The checkpoint's model with its weights (``weights``: ``raw`` as trained, or ``ema``, their
    moving average; ``where`` names the key that chose, for the error without one): built from its
    open_clip description (architecture, preprocessing, tokenizer; no pretrained file needed), or for
    checkpoints older than the description from the stored config (only megabatch's own targets: a
    crafted file runs nothing)."""
    if "open_clip" in state:
        model = from_description(state["open_clip"])
    else:
        model = build_stored(builder_node(OmegaConf.create(state["config"]).model), "model")
    model.load_state_dict(model_weights(state, weights, where))
    return model
