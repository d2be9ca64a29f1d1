"""The teacher of a distilled run (``distill.teacher``): a frozen CLIP encoded beside the student in
GradCache's first pass (never replayed), its features handed to the loss (``losses/distill.py``)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

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


def for_inference(model: ClipModel, gelu: str = "erf") -> ClipModel:
    """``model`` made faster to write embeddings with, in place (the same parameters): its attention computed
    directly by SDPA on the packed projection's views and a ViT's patch embedding as one GEMM
    (``models/attention.py``, ``models/patches.py``: the same features up to a reordered sum; what
    ``model.direct_attention`` and ``model.patch_gemm`` do in training) and, with ``gelu="tanh"``, its blocks'
    ``c_fc`` and GELU as one cuBLASLt GEMM whose epilogue computes the tanh form of the GELU (``models/mlp.py``;
    ``gelu="erf"``, the default, keeps the exact GELU and its own pass over the activations; the writers' ``auto``
    is ``tanh`` on a GPU, ``writing_gelu``).

    ViT-L/14's compiled bf16 forward alone on an H200, batch 256: 2,904 images/s with the exact GELU (its pass: 12%
    of the GPU time), 3,148 with the epilogue; 2,615 with open_clip's own blocks (docs/bench/embed_shards_*). The
    tanh form moves the features by less than the bf16 forward itself does: the smallest cosine to the exact GELU's
    features over 256 images was 0.99996, as inductor's autotuned GEMMs give with the exact GELU
    (``tests/train/test_stored_image_features.py`` holds it against float32 on the CPU). Returns it."""
    from ...models.attention import use_direct_attention
    from ...models.mlp import use_tanh_gelu
    from ...models.patches import use_patch_gemm

    if gelu not in ("tanh", "erf"):
        raise ValueError(f"gelu={gelu!r}: tanh or erf (auto: writing_gelu)")
    use_direct_attention(model, "sdpa")
    use_patch_gemm(model)
    if gelu == "tanh":
        use_tanh_gelu(model.clip)  # the blocks only: the model's own config (what it rebuilds) keeps its GELU
    return model


def writing_gelu(gelu: str, device: torch.device) -> str:
    """The writers' GELU (``make_shards.py --gelu``): ``auto`` is ``tanh`` where they run on a GPU (in bf16, fused:
    faster, and within bf16's own rounding) and the exact ``erf`` on the CPU (float32: no fused GEMM to gain)."""
    if gelu == "auto":
        return "tanh" if device.type == "cuda" else "erf"
    return gelu


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


def write_teacher_shards(urls: list[str], out: Path, teachers: list[tuple[str, Teacher]], *, key: str = "teacher.npy",
                         caption_key: str = "txt", batch: int = 256, dtype=np.float16, rank: int = 0,
                         world: int = 1, show_progress: bool = True, workers: int = 8) -> list[Path]:
    """Copies of the shards ``urls`` in ``out`` with each sample's teacher embeddings added as member ``key``
    (``[members, 2, width]``: its image's and its caption's, per teacher), and ``teacher.json`` (rank 0)
    and ``sizes.json`` (copied from the shards' own, when there). Rank ``rank`` of ``world`` writes every
    ``world``-th shard (``data/embedding_writer.py``: ``workers`` loader workers decode, the teachers encode
    ``batch`` images at a time; a shard already in ``out`` is skipped, so an interrupted run resumes). A sample
    without an image or a caption is copied without embeddings (a run skips and counts it). The images are cut
    to the largest teacher's size (a smaller one resizes them on the device). Returns the shards this rank
    wrote."""
    from ...data.embedding_writer import write_embedded_shards
    from ...data.teacher_store import SPEC_NAME, TeacherSpec

    widths = {teacher.width for _, teacher in teachers}
    if len(widths) != 1:
        raise ConfigError(f"the teachers' embedding widths differ ({sorted(widths)}): an ensemble's members must "
                          "share one width")
    spec = TeacherSpec(key, len(teachers), widths.pop(), tuple(teacher.scale for _, teacher in teachers),
                       tuple(name for name, _ in teachers))
    prepare_folder(out, urls, out / SPEC_NAME, spec, TeacherSpec.load(out, key) if (out / SPEC_NAME).exists() else None,
                   spec.to_json(caption_key), "other teachers", rank)

    encode, size = teacher_encoder([teacher for _, teacher in teachers])
    return write_embedded_shards([Path(url) for url in urls[rank::world]], out, key, encode, size=size,
                                 device=teachers[0][1].device, batch=batch, workers=workers, caption_key=caption_key,
                                 tokenizers=[teacher.model.tokenizer() for _, teacher in teachers], dtype=dtype,
                                 show_progress=show_progress, desc="teacher embeddings")


def teacher_encoder(teachers: list[Teacher]):
    """``(encode, size)``: ``encode(images, tokens)`` gives the teachers' embeddings ``[n, members, 2, width]`` of
    uint8 images of ``size`` (the largest teacher's; a smaller one resizes them on the device) and each teacher's
    token ids of their captions."""
    def encode(images: torch.Tensor, tokens: list[torch.Tensor]) -> torch.Tensor:
        per_teacher = []
        for teacher, ids in zip(teachers, tokens, strict=True):
            image_features, text_features = teacher(images, ids, contextlib.nullcontext)
            per_teacher.append(torch.stack([image_features.float(), text_features.float()], 1))
        return torch.stack(per_teacher, 1)

    return encode, max((teacher.size for teacher in teachers), key=lambda s: s[0] * s[1])


def write_image_feature_shards(urls: list[str], out: Path, model: ClipModel, device: torch.device, *,
                               key: str = "image.npy", batch: int = 256, dtype=np.float16, rank: int = 0,
                               world: int = 1, show_progress: bool = True, workers: int = 8,
                               compile: bool = True, gelu: str = "auto") -> list[Path]:
    """Copies of the shards ``urls`` in ``out`` with each sample's image features by ``model``'s image tower added
    as member ``key`` (``[width]``, L2-normalised, of the image's centre crop at the tower's size), for
    ``model.image_features=stored`` (``data/image_features.py``); ``image_features.json`` (rank 0: the tower's
    fingerprint, taken before the weights are cast) and ``sizes.json`` (copied from the shards' own, when
    there). Rank ``rank`` of ``world`` writes every ``world``-th shard; a shard already in ``out`` is skipped.
    On CUDA the tower runs in bf16, compiled (``compile``), its GELU ``gelu`` (``writing_gelu``). Returns the shards
    this rank wrote."""
    from ...data.embedding_writer import write_embedded_shards
    from ...data.image_features import SPEC_NAME, ImageFeatureSpec

    spec = ImageFeatureSpec.of_model(model, key)
    prepare_folder(out, urls, out / SPEC_NAME, spec,
                   ImageFeatureSpec.load(out, key) if (out / SPEC_NAME).exists() else None, spec.to_json(),
                   "another image tower's features", rank)
    tower = Teacher(for_inference(model, writing_gelu(gelu, device)), 1.0, device, compile=compile)
    encode, size = image_encoder(tower)
    return write_embedded_shards([Path(url) for url in urls[rank::world]], out, key, encode, size=size,
                                 device=device, batch=batch, workers=workers, dtype=dtype,
                                 show_progress=show_progress, desc="image features")


def image_encoder(tower: Teacher):
    """``(encode, size)``: ``encode(images, tokens)`` gives ``tower``'s (a frozen model: bf16 on CUDA, compiled
    where asked) L2-normalised image features ``[n, width]`` of uint8 images of ``size`` (its own), normalised
    with its mean and std; the tokens are not read."""
    dtype = next(tower.model.parameters()).dtype
    mean, std = tower.model.preprocess["mean"], tower.model.preprocess["std"]

    def encode(images: torch.Tensor, tokens: list[torch.Tensor]) -> torch.Tensor:
        return tower.encode_image(normalize_images(images, mean, std).to(dtype)).float()

    return encode, tower.size


def prepare_folder(out: Path, urls: list[str], spec_path: Path, spec, found, text: str, other: str, rank: int) -> None:
    """``out`` made, and refused where ``spec_path`` there (``found``, read) describes other embeddings than ``spec``
    (``other`` says what, for the message); rank 0 writes ``text`` there and copies beside the copies what describes
    the shards' members, when there: ``sizes.json`` (their sample counts) and the other stored embeddings'
    description (the copies keep those members: image features written onto shards with a teacher's embeddings)."""
    from ...data import image_features, teacher_store

    out.mkdir(parents=True, exist_ok=True)
    if found is not None and found != spec:
        raise ConfigError(f"{spec_path} describes {other} ({spec_path.read_text().strip()}): write these embeddings "
                          "to another folder")
    if rank == 0:
        spec_path.write_text(text)
        for name in ("sizes.json", teacher_store.SPEC_NAME, image_features.SPEC_NAME):
            source = Path(urls[0]).parent / name
            if name != spec_path.name and source.is_file():
                (out / name).write_text(source.read_text())
