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
from dataclasses import dataclass, field
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
    # the .npy headers met so far, each loader worker its own (read_npy)
    headers: dict = field(default_factory=dict, compare=False, repr=False)

    def read(self, sample: dict) -> np.ndarray | None | str:
        """``sample``'s embeddings ``[members, 2, width]`` in their stored dtype (float16 or float32: the
        device makes them float32, ``train/step/teacher.py``); ``None`` where it has none; ``"bad"`` where they do
        not parse or have another shape (a wrong width, another ensemble)."""
        data = sample.get(self.key)
        if data is None:
            return None
        array = read_npy(data, self.headers)
        if array is None:
            return "bad"
        if array.ndim == 2:
            array = array[None]
        if array.shape != (self.members, 2, self.width) or array.dtype.kind != "f" or not np.isfinite(array).all():
            return "bad"
        return array

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


def read_npy(data, headers: dict) -> np.ndarray | None:
    """A ``.npy`` member's array (``None`` where it does not parse). ``headers``: the headers met so far (bytes ->
    dtype, shape, the member's length), each loader worker its own; a member with one of them is read as the bytes
    after it, as ``np.load`` reads them, without parsing it again (``np.load`` takes ~26 us a sample; a loader worker
    reads a 1M step's samples in a few thousand sub-batches). A float array's header joins them (8 at most)."""
    data = data if isinstance(data, bytes) else bytes(data)
    for header, (dtype, shape, length) in headers.items():
        if len(data) == length and data.startswith(header):
            return np.frombuffer(data, dtype=dtype, offset=len(header)).reshape(shape)
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception:  # noqa: BLE001 - any unreadable member is a bad sample
        return None
    if array.dtype.kind == "f" and array.flags.c_contiguous and len(headers) < 8:
        headers[bytes(data[:len(data) - array.nbytes])] = (array.dtype, array.shape, len(data))
    return array


def encode_embeddings(array: np.ndarray) -> bytes:
    """A sample's stored array (teacher embeddings ``[members, 2, width]``, image features ``[width]``) as ``.npy``
    bytes (its dtype kept)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()
