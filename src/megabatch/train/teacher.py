"""The teacher of a distilled run (``distill.teacher``): a frozen CLIP encoded beside the student in
GradCache's first pass (never replayed), its features handed to the loss (``losses/distill.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from ..config import ConfigError
from ..images import normalize_images
from ..models import ClipModel

log = logging.getLogger("megabatch")

PROBE = "a photo of a dog, 3 cats and a zebra."  # compared tokenised by the teacher's and the student's tokenizers


class Teacher:
    """A frozen ``ClipModel`` (no gradient, not in the optimizer, eval mode; bf16 weights on CUDA)
    called on the student's inputs: uint8 images (resized on the device to the teacher's size where
    it differs, normalised with its own mean and std) and the student's token ids (padded to its
    context). ``scale``: the multiplier of the teacher's logits (its own ``logit_scale.exp()``, or
    ``1 / distill.temperature``)."""

    def __init__(self, model: ClipModel, scale: float, device: torch.device):
        self.model = model.to(device).eval().requires_grad_(False)
        if device.type == "cuda":
            self.model.to(torch.bfloat16)
        self.scale, self.device = float(scale), device
        size = model.image_size
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.context = model.context_length

    @property
    def width(self) -> int:
        """The teacher's embedding width."""
        return int(self.model.model_cfg["embed_dim"])

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, texts: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's L2-normalised image and text features of a sub-batch (``images`` on the
        device, ``texts`` anywhere), under ``autocast`` (the step's precision)."""
        images = normalize_images(images, self.model.preprocess["mean"], self.model.preprocess["std"])
        if tuple(images.shape[-2:]) != self.size:
            images = F.interpolate(images, size=self.size, mode="bicubic", antialias=True, align_corners=False)
        texts = texts.to(self.device, non_blocking=True)
        if texts.shape[1] < self.context:  # the student's shorter context: open_clip pads with 0
            texts = F.pad(texts, (0, self.context - texts.shape[1]))
        dtype = next(self.model.parameters()).dtype
        with autocast():
            return self.model.encode_image(images.to(dtype)), self.model.encode_text(texts)


def load_teacher_model(distill: DictConfig) -> ClipModel:
    """``distill.teacher``'s model: an open_clip architecture (weights from ``distill.pretrained``, or
    random without), a megabatch checkpoint (a ``.pt`` file or ``.dcp`` folder) or an export folder
    (``scripts/export.py``)."""
    from ..models import build_openclip

    teacher = str(distill.teacher)
    path = Path(teacher).expanduser()
    if path.exists():
        if distill.pretrained is not None:
            raise ConfigError(f"distill.pretrained={distill.pretrained!r} is for a teacher named by its architecture; "
                              f"distill.teacher={teacher!r} is a file or folder with its own weights: drop "
                              "distill.pretrained")
        if path.is_dir() and (path / "open_clip_config.json").is_file():  # an export
            return build_openclip(pretrained=str(path))
        from ..checkpoint import load_checkpoint
        from ..eval.checkpoint import model_from_checkpoint

        try:
            return model_from_checkpoint(load_checkpoint(path), where="distill.teacher")
        except ConfigError as error:
            raise ConfigError(f"distill.teacher={teacher!r}: {error}") from error
    import open_clip

    if teacher not in open_clip.list_models():
        raise ConfigError(f"distill.teacher={teacher!r} is neither a file or folder nor an open_clip architecture: "
                          "give a megabatch checkpoint (.pt, .dcp), an export folder, or an architecture such as "
                          "distill.teacher=ViT-L-14 with distill.pretrained=<its weights file>")
    if distill.pretrained is None:
        log.warning("distill.teacher=%s has random weights (distill.pretrained is null): fine for timing, not for "
                    "learning", teacher)
    return build_openclip(arch=teacher, pretrained=distill.pretrained)


def check_tokenizers(teacher: ClipModel, student: ClipModel) -> None:
    """The teacher reads the student's token ids: its tokenizer must give the same ids, and its
    context must hold the student's."""
    if student.context_length > teacher.context_length:
        raise ConfigError(f"distill.teacher {teacher.name} reads {teacher.context_length} tokens, the student "
                          f"{student.context_length}: give the student a context of at most "
                          f"{teacher.context_length} (model.text.context_length) or another teacher")
    ours, theirs = student.tokenizer()([PROBE]), teacher.tokenizer()([PROBE])
    length = min(ours.shape[1], theirs.shape[1])
    if not torch.equal(ours[:, :length], theirs[:, :length]):
        raise ConfigError(f"distill.teacher {teacher.name} tokenizes captions differently from the student "
                          f"{student.name} (it reads the student's token ids): take a teacher with the same "
                          "tokenizer")


def build_teacher(distill: DictConfig, student: ClipModel, device: torch.device) -> Teacher:
    """The frozen teacher of ``distill`` for ``student`` on ``device``, checked against it."""
    model = load_teacher_model(distill)
    check_tokenizers(model, student)
    scale = model.logit_scale.exp().item() if distill.temperature is None else 1.0 / float(distill.temperature)
    return Teacher(model, scale, device)
