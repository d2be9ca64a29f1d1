"""Stored teacher embeddings (``distill.teacher=stored``): each sample's teacher image and text embeddings
kept in its shard as one ``.npy`` member (``data.train.teacher_key``, e.g. ``teacher.npy``), written by
``scripts/make_shards.py teacher``; ``teacher.json`` beside the shards says what they are.

A sample's array is ``[members, 2, width]`` (row 0 the image's embedding, row 1 the caption's, each
L2-normalised; ``members`` > 1: an ensemble of teachers), float16 or float32. ``teacher.json``:
``{"key": ..., "members": M, "width": e, "scales": [one logit scale per member], "teachers": [names],
"caption_key": ...}``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError

SPEC_NAME = "teacher.json"


@dataclass(frozen=True)
class TeacherSpec:
    """What a run reads: the member ``key`` of each sample, the array's shape (``members``, ``width``),
    each member's logit ``scales`` and ``teachers`` (names, for the log)."""

    key: str
    members: int
    width: int
    scales: tuple[float, ...]
    teachers: tuple[str, ...] = ()

    def read(self, sample: dict) -> np.ndarray | None | str:
        """``sample``'s embeddings as float32 ``[members, 2, width]``; ``None`` where it has none; ``"bad"``
        where they do not parse or have another shape (a wrong width, another ensemble)."""
        data = sample.get(self.key)
        if data is None:
            return None
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception:  # noqa: BLE001 - any unreadable member is a bad sample
            return "bad"
        if array.ndim == 2:
            array = array[None]
        if array.shape != (self.members, 2, self.width) or not np.isfinite(array).all():
            return "bad"
        return array.astype(np.float32, copy=False)

    @classmethod
    def load(cls, folder: Path, key: str) -> TeacherSpec:
        """The spec in ``folder``'s ``teacher.json`` (a config error naming the key and the file when it
        is missing, unreadable or for another member key)."""
        path = folder / SPEC_NAME
        try:
            spec = json.loads(path.read_text())
            members, width, scales = int(spec["members"]), int(spec["width"]), [float(s) for s in spec["scales"]]
        except FileNotFoundError:
            raise ConfigError(f"data.train.teacher_key={key}: {path} does not exist; stored teacher embeddings are "
                              "written with their teacher.json by scripts/make_shards.py teacher") from None
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"data.train.teacher_key={key}: {path} is not a teacher.json of "
                              f"scripts/make_shards.py teacher ({error})") from None
        if spec.get("key", key) != key:
            raise ConfigError(f"data.train.teacher_key={key}, but {path} describes embeddings stored under "
                              f"{spec['key']!r}: set data.train.teacher_key={spec['key']}")
        if len(scales) != members:
            raise ConfigError(f"{path}: {members} members but {len(scales)} scales")
        return cls(key, members, width, tuple(scales), tuple(spec.get("teachers", ())))

    def to_json(self, caption_key: str = "txt") -> str:
        return json.dumps({"key": self.key, "members": self.members, "width": self.width, "scales": list(self.scales),
                           "teachers": list(self.teachers), "caption_key": caption_key}, indent=1)


def encode_embeddings(array: np.ndarray) -> bytes:
    """A sample's ``[members, 2, width]`` array as ``.npy`` bytes (its dtype kept)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()
