"""Which caption of a sample a training step reads (``data.train.text_key``, ``data.train.text_probs``).

A sample may carry several captions: the alt-text (``txt``) beside synthetic recaptions, in their own
files (``recaption.txt``: key ``recaption.txt``) or in its JSON (``json:recaption``; a dotted path
``json:captions.blip2`` reads nested fields; a field holding a list offers each of its strings).
``CaptionKeys.pick`` draws one of those present with the keys' probabilities (a key's share split
evenly over the strings it holds; renormalised over the keys the sample has), from a generator seeded
by the run's seed, the epoch and the sample's position in the epoch's stream alone: a resume, on any
number of ranks and loader workers, reads the same captions where the split gives the same positions
(``indexed`` and ``position``). A sample with none of the keys has no caption: it is skipped and
counted (``missing_caption``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from ..config.schema import check_text_keys

JSON = "json:"  # a key read from the sample's JSON file: json:<field>[.<field>...]


class CaptionKeys:
    """``keys``: one key or several (``txt``, ``json:recaption``, ...); ``probs``: one weight per key
    (``None``: equal); ``seed``, ``epoch``: the draw's (with the sample's position)."""

    def __init__(self, keys: str | Sequence[str] = "txt", probs: Sequence[float] | None = None, seed: int = 0,
                 epoch: int = 0, negatives_key: str | None = None, negatives: int = 1, teacher=None):
        self.keys = [keys] if isinstance(keys, str) else [str(key) for key in keys]
        check_text_keys(self.keys, probs)
        self.probs = [1.0] * len(self.keys) if probs is None else [float(p) for p in probs]
        self.seed, self.epoch = seed, epoch
        self.negatives_key, self.negatives = negatives_key, int(negatives)
        self.teacher = teacher  # distill.teacher=stored: the stored embeddings' TeacherSpec (data/teacher_store.py)

    def for_epoch(self, seed: int, epoch: int) -> CaptionKeys:
        return CaptionKeys(self.keys, self.probs, seed, epoch, self.negatives_key, self.negatives, self.teacher)

    def negatives_of(self, sample: dict) -> list[str] | None:
        """``negatives`` hard-negative captions of ``sample`` from ``negatives_key`` (a JSON list, or a
        text file of one caption a line): the first ``negatives``, cycled where it holds fewer; ``None``
        where it holds none."""
        key = self.negatives_key
        if key.startswith(JSON):
            found = self._values(sample, key, {})
        else:
            text = text_of(sample.get(key))
            found = [line for line in (text or "").splitlines() if line.strip()]
        found = [text for text in found if text.strip()]
        if not found:
            return None
        return [found[i % len(found)] for i in range(self.negatives)]

    def describe(self) -> str:
        return " or ".join(self.keys)

    def pick(self, sample: dict, position: int) -> str | None:
        """The caption of ``sample`` (a webdataset sample: extension -> bytes) at ``position`` of the
        epoch, or ``None`` where it has none of the keys (or only empty ones)."""
        if len(self.keys) == 1 and not self.keys[0].startswith(JSON):  # the common case: one file, as it is
            value = sample.get(self.keys[0])
            return value.decode("utf-8", errors="replace") if isinstance(value, (bytes, bytearray)) else value
        candidates, parsed = [], {}
        for key, prob in zip(self.keys, self.probs, strict=True):
            texts = [text for text in self._values(sample, key, parsed) if text]
            candidates.extend((text, prob / len(texts)) for text in texts if prob > 0)
        if len(candidates) <= 1:
            return candidates[0][0] if candidates else None
        total = sum(weight for _, weight in candidates)
        draw = random.Random((self.seed * 1_000_003 + self.epoch) * 10_000_019 + position + 0x5EED).random() * total
        for text, weight in candidates:
            draw -= weight
            if draw < 0:
                return text
        return candidates[-1][0]

    @staticmethod
    def _values(sample: dict, key: str, parsed: dict) -> list[str]:
        """The strings ``key`` holds in ``sample`` (``parsed``: its JSON, read once per sample)."""
        if not key.startswith(JSON):
            text = text_of(sample.get(key))
            return [text] if text else []
        if "json" not in parsed:
            try:
                parsed["json"] = json.loads(sample["json"]) if sample.get("json") is not None else None
            except (ValueError, UnicodeDecodeError):
                parsed["json"] = None  # an unreadable JSON offers nothing: the other keys, or skipped
        node = parsed["json"]
        for field in key[len(JSON):].split("."):
            node = node.get(field) if isinstance(node, dict) else None
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [item for item in node if isinstance(item, str)]
        return []


def text_of(value) -> str | None:
    """A caption file's text (bytes decoded), ``None`` where absent or empty."""
    if value is None:
        return None
    text = value.decode("utf-8", errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)
    return text if text.strip() else None
