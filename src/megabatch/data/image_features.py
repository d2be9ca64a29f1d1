"""Stored image features (``model.image_features=stored``, LiT from stored features): a locked image tower's
own L2-normalised features of each sample's image, kept in its shard as one ``.npy`` member
(``data.train.image_features_key``, e.g. ``image.npy``) and read in place of the image, so that a run with a
locked image tower trains its text tower without encoding an image. ``scripts/make_shards.py image-features``
writes them once from the tower (its evaluation preprocessing: the shorter side resized to the tower's size,
the centre cropped); ``image_features.json`` beside the shards says which tower (``tower_fingerprint``), so
that a run whose tower is another one stops before its first step instead of training against features that
are not its own.

A sample's array is ``[width]``, float16 or float32. ``image_features.json``: ``{"key": ..., "width": e,
"fingerprint": ..., "tower": name, "size": [h, w], "mean": [...], "std": [...], "quick_gelu": bool}``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from .teacher_store import read_npy

SPEC_NAME = "image_features.json"


def tower_fingerprint(tower: torch.nn.Module) -> str:
    """A digest of ``tower``'s weights (its state dict as float32 values, names and shapes included, in name
    order): equal for the same weights wherever they were loaded, on any device and in any dtype they were
    held in as float32 (bf16 weights give another digest: the writer fingerprints the tower before casting)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tower.state_dict().items()):
        if not torch.is_tensor(tensor) or not tensor.is_floating_point():
            continue
        values = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(values.shape)};".encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class ImageFeatureSpec:
    """What a run reads in place of the images: member ``key`` of each sample, ``width`` values, written by the
    image tower whose weights give ``fingerprint``, at its preprocessing (``size``, ``mean``, ``std``) and
    activation (``quick_gelu``); ``tower``: its name, for the messages."""

    key: str
    width: int
    fingerprint: str
    tower: str = ""
    size: tuple[int, int] = (0, 0)
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    quick_gelu: bool = False
    # the .npy headers met so far, each loader worker its own (teacher_store.read_npy)
    headers: dict = field(default_factory=dict, compare=False, repr=False)

    def decode(self, data: bytes | None) -> torch.Tensor:
        """A sample's stored features as a ``[width]`` tensor in their stored dtype (the device makes them float32);
        raises ``ValueError`` where the sample has none, or they do not parse, have another width or are not
        finite (the loader skips and counts the sample, as it does a corrupt image)."""
        if data is None:
            raise ValueError(f"no stored image features ({self.key}) in the sample")
        array = read_npy(data, self.headers)
        if array is None:
            raise ValueError(f"unreadable stored image features ({self.key})")
        if array.shape != (self.width,) or array.dtype.kind != "f" or not np.isfinite(array).all():
            raise ValueError(f"stored image features ({self.key}) of shape {tuple(array.shape)} and dtype {array.dtype}"
                             f" ([{self.width}] finite values expected)")
        return torch.from_numpy(array.copy())

    @classmethod
    def of_model(cls, model, key: str) -> ImageFeatureSpec:
        """The spec of ``model``'s (a ``ClipModel``'s) image tower as it is now (fingerprint it before casting)."""
        preprocess = model.preprocess
        size = preprocess["size"]
        return cls(key, int(model.model_cfg["embed_dim"]), tower_fingerprint(model.clip.visual), str(model.name),
                   (size, size) if isinstance(size, int) else tuple(int(s) for s in size),
                   tuple(float(v) for v in preprocess["mean"]), tuple(float(v) for v in preprocess["std"]),
                   bool(model.model_cfg.get("quick_gelu", False)))

    def check(self, model, where: str) -> None:
        """A ``ConfigError`` unless ``model``'s image tower is the one that wrote these features (``where``: the
        folder, for the message): its weights, width, preprocessing and activation."""
        ours = ImageFeatureSpec.of_model(model, self.key)
        differences = [f"{name} {theirs!r} there, {mine!r} here" for name, theirs, mine in (
            ("width", self.width, ours.width), ("image size", self.size, ours.size), ("mean", self.mean, ours.mean),
            ("std", self.std, ours.std), ("quick_gelu", self.quick_gelu, ours.quick_gelu)) if theirs != mine]
        if self.fingerprint != ours.fingerprint:
            differences.insert(0, f"the weights (fingerprint {self.fingerprint} there, {ours.fingerprint} here)")
        if differences:
            raise ConfigError(f"model.image_features=stored: the features in {where} were written by image tower "
                              f"{self.tower!r}, which is not this run's ({model.name}): {'; '.join(differences)}. "
                              "Train with the tower that wrote them (the same model.pretrained / model.image.ckpt "
                              "and model config), or write this tower's: scripts/make_shards.py image-features")

    @classmethod
    def load(cls, folder: Path, key: str) -> ImageFeatureSpec:
        """The spec in ``folder``'s ``image_features.json`` (a config error naming the key and the file when it is
        missing, unreadable or for another member key)."""
        path = folder / SPEC_NAME
        try:
            spec = json.loads(path.read_text())
            loaded = cls(str(spec["key"]), int(spec["width"]), str(spec["fingerprint"]), str(spec.get("tower", "")),
                         tuple(int(s) for s in spec["size"]), tuple(float(v) for v in spec["mean"]),
                         tuple(float(v) for v in spec["std"]), bool(spec.get("quick_gelu", False)))
        except FileNotFoundError:
            raise ConfigError(f"data.train.image_features_key={key}: {path} does not exist; stored image features are "
                              "written with their image_features.json by scripts/make_shards.py image-features"
                              ) from None
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"data.train.image_features_key={key}: {path} is not an image_features.json of "
                              f"scripts/make_shards.py image-features ({error})") from None
        if loaded.key != key:
            raise ConfigError(f"data.train.image_features_key={key}, but {path} describes features stored under "
                              f"{loaded.key!r}: set data.train.image_features_key={loaded.key}")
        return loaded

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "width": self.width, "fingerprint": self.fingerprint, "tower": self.tower,
                           "size": list(self.size), "mean": list(self.mean), "std": list(self.std),
                           "quick_gelu": self.quick_gelu}, indent=1)

