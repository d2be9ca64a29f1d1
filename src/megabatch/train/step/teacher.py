"""The teacher of a distilled run (``distill.teacher``): a frozen CLIP encoded beside the student in
GradCache's first pass (never replayed), its features handed to the loss (``losses/distill.py``)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm import tqdm

from ...config import ConfigError
from ...config.run import DistillSettings
from ...models import ClipModel
from ...models.images import normalize_images

log = logging.getLogger("megabatch")

PROBE = "a photo of a dog, 3 cats and a zebra."  # compared tokenised by the teacher's and the student's tokenizers


class Teacher:
    """A frozen ``ClipModel`` (no gradient, not in the optimizer, eval mode; bf16 weights on CUDA)
    called on the student's inputs: uint8 images (resized on the device to the teacher's size where
    it differs, normalised with its own mean and std) and the student's token ids (padded to its
    context). ``scale``: the multiplier of the teacher's logits (its own ``logit_scale.exp()``, or
    ``1 / distill.temperature``)."""

    def __init__(self, model: ClipModel, scale: float, device: torch.device, compile: bool = False,
                 shard: bool = False):
        self.model = model.to(device).eval().requires_grad_(False)
        if device.type == "cuda":
            self.model.to(torch.bfloat16)
        self.scale, self.device = float(scale), device
        # trainer.parallel=fsdp on several ranks: the teacher sharded as the student (each rank holds 1/W of its
        # weights; every rank encodes as many sub-batches, so its blocks' gathers run in lockstep)
        self.sharded = shard
        if shard:
            from ...distributed.fsdp import shard_model

            shard_model(self.model, device, bf16=False)
        # distill.compile (CUDA): the encoders compiled at their first sub-batch (no graph: inference only); a
        # sharded teacher runs eagerly (its FSDP hooks wrap the methods the compiler would have traced past)
        compiled = compile and device.type == "cuda" and not shard
        self.encode_image = torch.compile(self.model.encode_image) if compiled else self.model.encode_image
        self.encode_text = torch.compile(self.model.encode_text) if compiled else self.model.encode_text
        self.compiled = compiled
        size = model.image_size
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.context = model.context_length

    @property
    def shape(self) -> tuple[int, ...]:
        """A sample's features: ``(width,)``."""
        return (self.width,)

    @property
    def width(self) -> int:
        return int(self.model.model_cfg["embed_dim"])

    def features(self, sub, images: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """Sub-batch ``sub``'s teacher features (``images``: its images on the device)."""
        return self(images, sub.texts, autocast)

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
            return self.encode_image(images.to(dtype)), self.encode_text(texts)


class StoredTeacher:
    """``distill.teacher=stored``: the teacher features each sub-batch carries from its shards
    (``SubBatch.teacher``, ``data/teacher_store.py``): no teacher runs. An ensemble's members stay apart
    (``[n, members, width]``): the loss averages their probabilities. ``scale``: one per member."""

    def __init__(self, spec, scales: tuple[float, ...], device: torch.device):
        self.spec, self.scale, self.device = spec, scales if len(scales) > 1 else scales[0], device
        self.model = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.spec.width,) if self.spec.members == 1 else (self.spec.members, self.spec.width)

    @property
    def width(self) -> int:
        return self.spec.width

    def features(self, sub, images: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        if sub.teacher is None:
            raise RuntimeError("distill.teacher=stored but the sub-batch carries no teacher embeddings "
                               "(data.train.teacher_key)")
        # [n, members, 2, width], float16 as most shards store them: half the bytes through the loader and the copy
        stored = sub.teacher.to(self.device, non_blocking=True).float()
        if self.spec.members == 1:
            stored = stored[:, 0]
            return stored[:, 0], stored[:, 1]
        return stored[:, :, 0], stored[:, :, 1]


def load_teacher_model(distill: DistillSettings | DictConfig) -> ClipModel:
    """``distill.teacher``'s model: an open_clip architecture (weights from ``distill.pretrained``, or
    random without), a megabatch checkpoint (a ``.pt`` file or ``.dcp`` folder) or an export folder
    (``scripts/export.py``)."""
    from ...models import build_openclip

    teacher = str(distill.teacher)
    path = Path(teacher).expanduser()
    if path.exists():
        if distill.pretrained is not None:
            raise ConfigError(f"distill.pretrained={distill.pretrained!r} is for a teacher named by its architecture; "
                              f"distill.teacher={teacher!r} is a file or folder with its own weights: drop "
                              "distill.pretrained")
        if path.is_dir() and (path / "open_clip_config.json").is_file():  # an export
            return build_openclip(pretrained=str(path))
        from ...checkpoint.files import load_checkpoint
        from ...checkpoint.model import model_from_checkpoint

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
    try:
        return build_openclip(arch=teacher, pretrained=distill.pretrained)
    except ConfigError as error:  # the builder names the student's keys: these are the teacher's
        message = str(error)
        if message.startswith("model.pretrained="):
            message = "distill.pretrained=" + message.removeprefix("model.pretrained=").replace(
                f"model.arch={teacher}", f"distill.teacher={teacher}", 1)
        raise ConfigError(message) from error


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


def build_teacher(distill: DistillSettings, student: ClipModel, device: torch.device, spec=None,
                  compile: bool = False, shard: bool = False) -> Teacher | StoredTeacher:
    """The frozen teacher of ``distill`` for ``student`` on ``device``, checked against it; with
    ``distill.teacher=stored`` the stored embeddings ``spec`` describes (the training data's). ``compile``: its
    encoders through ``torch.compile`` (``distill.compile``, else ``model.compile``); ``shard``: its weights
    sharded over the ranks (``trainer.parallel=fsdp``)."""
    if distill.teacher == "stored":
        if spec is None:
            raise ConfigError("distill.teacher=stored reads each sample's teacher embeddings from the shards: set "
                              "data.train.teacher_key (e.g. teacher.npy, as scripts/make_shards.py teacher writes)")
        scales = spec.scales if distill.temperature is None else (1.0 / float(distill.temperature),) * spec.members
        return StoredTeacher(spec, tuple(scales), device)
    model = load_teacher_model(distill)
    check_tokenizers(model, student)
    scale = model.logit_scale.exp().item() if distill.temperature is None else 1.0 / float(distill.temperature)
    return Teacher(model, scale, device, compile, shard)


def _teacher_images(images: list[torch.Tensor], size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``[3, h, w]`` images as the teacher's ``[n, 3, *size]``: the shorter side resized to the size
    (bicubic, antialiased), then the centre cropped (open_clip's evaluation preprocessing, on uint8);
    an image of the size already is taken as it is."""
    from torchvision.transforms.v2 import functional as TF

    out = []
    for image in images:
        if tuple(image.shape[-2:]) != size:
            image = TF.center_crop(TF.resize(image, min(size), interpolation=TF.InterpolationMode.BICUBIC,
                                             antialias=True), list(size))
        out.append(image)
    return torch.stack(out)


def write_teacher_shards(urls: list[str], out: Path, teachers: list[tuple[str, Teacher]], *, key: str = "teacher.npy",
                         caption_key: str = "txt", batch: int = 256, dtype=np.float16, rank: int = 0,
                         world: int = 1, show_progress: bool = True) -> list[Path]:
    """Copies of the shards ``urls`` in ``out`` with each sample's teacher embeddings added as member ``key``
    (``[members, 2, width]``: its image's and its caption's, per teacher), and ``teacher.json`` (rank 0)
    and ``sizes.json`` (copied from the shards' own, when there). Rank ``rank`` of ``world`` writes every
    ``world``-th shard; a shard already in ``out`` is skipped (each is written to a temporary name and
    renamed when whole: an interrupted run resumes). A sample without an image or a caption is copied
    without embeddings (a run skips and counts it). Returns the shards this rank wrote."""
    import tarfile

    from ...data.samples import IMAGE_KEYS, decode_rgb
    from ...data.teacher_store import SPEC_NAME, TeacherSpec, encode_embeddings

    widths = {teacher.width for _, teacher in teachers}
    if len(widths) != 1:
        raise ConfigError(f"the teachers' embedding widths differ ({sorted(widths)}): an ensemble's members must "
                          "share one width")
    spec = TeacherSpec(key, len(teachers), widths.pop(), tuple(teacher.scale for _, teacher in teachers),
                       tuple(name for name, _ in teachers))
    out.mkdir(parents=True, exist_ok=True)
    written_spec = out / SPEC_NAME
    if written_spec.exists() and TeacherSpec.load(out, key) != spec:
        raise ConfigError(f"{written_spec} describes other teachers ({written_spec.read_text().strip()}): write "
                          "these embeddings to another folder")
    if rank == 0:
        written_spec.write_text(spec.to_json(caption_key))
        sizes = Path(urls[0]).parent / "sizes.json"
        if sizes.is_file():
            (out / "sizes.json").write_text(sizes.read_text())
    tokenizers = [teacher.model.tokenizer() for _, teacher in teachers]  # built once, not per chunk
    mine = [Path(url) for url in urls[rank::world]]
    suffix = "." + key
    written = []
    progress = tqdm(total=len(mine), desc="teacher embeddings", unit="shard", disable=not show_progress)
    for source in mine:
        target = out / source.name
        if target.exists():
            progress.update(1)
            continue
        with tarfile.open(source) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]
        samples: dict[str, dict[str, bytes]] = {}
        for member, data in members:
            name = member.name
            sample_key, _, ext = name.partition(".")
            samples.setdefault(sample_key, {})[ext] = data
        usable = [k for k, sample in samples.items()
                  if any(e in sample for e in IMAGE_KEYS) and caption_key in sample]
        embeddings = {}
        for start in range(0, len(usable), batch):
            chunk = usable[start:start + batch]
            images = [decode_rgb(next(samples[k][e] for e in IMAGE_KEYS if e in samples[k])) for k in chunk]
            captions = [samples[k][caption_key].decode("utf-8").strip() for k in chunk]
            per_teacher = []
            for (_, teacher), tokenizer in zip(teachers, tokenizers, strict=True):
                pixels = _teacher_images(images, teacher.size).to(teacher.device)
                tokens = tokenizer(captions)
                image_features, text_features = teacher(pixels, tokens, contextlib.nullcontext)
                per_teacher.append(torch.stack([image_features.float(), text_features.float()], 1).cpu())
            stacked = torch.stack(per_teacher, 1).numpy().astype(dtype)  # [n, members, 2, width]
            embeddings.update(zip(chunk, stacked, strict=True))
        partial = target.with_name(target.name + ".partial")
        with tarfile.open(partial, "w") as tar:
            def add(name: str, data: bytes) -> None:
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))

            for sample_key, sample in samples.items():
                for ext, data in sample.items():
                    if ext != key:
                        add(f"{sample_key}.{ext}", data)
                if sample_key in embeddings:
                    add(sample_key + suffix, encode_embeddings(embeddings[sample_key]))
        os.replace(partial, target)
        written.append(target)
        progress.update(1)
    progress.close()
    return written
