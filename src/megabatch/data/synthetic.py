"""Synthetic data for the tests and the benchmarks: photo-like JPEG samples with web-like captions,
written as shards, and random image/token sub-batches on a device. A run never reads them."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .samples import SubBatch
from .shard_writer import Sample, write_shards


def photos(count: int, size: int, seed: int = 0, negatives: int = 0,
           aspects: tuple[float, ...] = (1.0,)) -> Iterator[Sample]:
    """``count`` distinct JPEG samples of ``size`` px: smooth random pictures with noise, which
    compress like photos (about 33 KB at 256 px). ``negatives``: that many more captions each, in
    the sample's JSON (``negatives``: hard negatives' stand-ins, drawn from a generator of their own).
    ``aspects``: width / height ratios, cycled (the area stays ``size``^2): images of mixed aspect ratios."""
    from PIL import Image

    rng, other = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    for index in range(count):
        aspect = aspects[index % len(aspects)]
        width, height = round(size * aspect ** 0.5), round(size / aspect ** 0.5)
        coarse = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
        noise = rng.normal(0, 12, (height, width, 3))
        pixels = np.clip(np.asarray(image, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        meta = {"negatives": [caption(other) for _ in range(negatives)]} if negatives else {}
        yield Sample(buffer.getvalue(), "jpg", caption(rng), meta)


# one BPE token each in CLIP's vocabulary: a caption of n words is n + 2 tokens (start and end)
WORDS = ("a photo of the red blue green small large old new dog cat car house tree man woman city "
         "street water sky white black on in with and at for day night view art design wall room").split()


def caption(rng: np.random.Generator) -> str:
    """A caption whose length follows web alt-text's (LAION, CC12M): log-normal, median 15 tokens,
    mean ~19, about 1% longer than CLIP's 77-token context (cut there by the tokenizer)."""
    words = int(np.clip(round(rng.lognormal(np.log(13), 0.7)), 1, 120))
    return " ".join(rng.choice(WORDS, words))


def photo_shards(count: int, size: int, folder: str | Path, per_shard: int = 1024, negatives: int = 0,
                 aspects: tuple[float, ...] = (1.0,)) -> list[str]:
    """``photos`` written as img2dataset-style shards (with ``sizes.json``) under ``folder``."""
    return write_shards(photos(count, size, negatives=negatives, aspects=aspects), Path(folder), "photo", per_shard)


def synthetic_sub_batch(sub_batch: int, image_size: int, context: int, device) -> SubBatch:
    """One random image/token sub-batch on ``device`` (end-of-text token last, as a tokenizer pads)."""
    generator = torch.Generator(device=device).manual_seed(0)
    images = torch.randn(sub_batch, 3, image_size, image_size, device=device, generator=generator)
    texts = torch.randint(1, 49407, (sub_batch, context), device=device, generator=generator)
    texts[:, -1] = 49407
    return SubBatch(images, texts, None)


