"""The embedded default data: scikit-learn's handwritten digits as image-caption shards.

1,797 real 8x8 scans (bundled with scikit-learn, no download) are upscaled to 32x32 and paired with
captions in several phrasings ("a photo of the digit seven", "a handwritten 7", ...). A stratified
20% held-out split is the zero-shot evaluation set. Built on first use into a cache directory.
Each sample's JSON also holds a second phrasing (``recaption``: ``data.train.text_key='[txt,json:recaption]'``)
and three captions of other digits (``negatives``: ``data.train.negatives_key=json:negatives``), drawn
from a generator of their own: the images and captions are those of version 1.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .shard_writer import Sample, encode_png, shard_pattern, write_shards

log = logging.getLogger(__name__)

CLASS_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

# Training captions: several phrasings per class, numerals and words mixed, so the text tower must
# learn that "7" and "seven" name the same thing.
CAPTION_PHRASINGS = [
    "a photo of the digit {word}",
    "a handwritten {num}",
    "a handwritten digit {word}",
    "the number {word}",
    "an image of the numeral {num}",
    "a scan of a handwritten {word}",
    "a blurry photo of the number {num}",
    "a pixelated {word}",
    "a drawing of the digit {num}",
    "{word}",
]

# Zero-shot prompts for the held-out split (class names are the words above), in the style of the
# training captions (no final period, as in those: a period the text tower never saw costs ~10
# points of top-1 on the tiny model).
EVAL_TEMPLATES = [
    "a photo of the digit {}",
    "a handwritten digit {}",
    "the number {}",
    "a scan of a handwritten {}",
]

IMAGE_SIZE = 32
HELD_OUT_FRACTION = 0.2
VERSION = 2  # bump when the generated data changes, so caches rebuild (2: recaption and negatives in the JSON)
NEGATIVES = 3  # captions of other digits a sample (its hard negatives)


def _upscale(image_8x8: np.ndarray) -> np.ndarray:
    from PIL import Image

    pixels = (image_8x8 * (255.0 / 16.0)).round().astype(np.uint8)
    return np.asarray(Image.fromarray(pixels).resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC))


def digit_samples(split: str, seed: int = 0) -> Iterator[Sample]:
    """Samples of ``split`` ("train" or "test"), in a fixed shuffled order."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    indices = np.arange(len(digits.target))
    train_idx, test_idx = train_test_split(
        indices, test_size=HELD_OUT_FRACTION, stratify=digits.target, random_state=seed
    )
    chosen = {"train": train_idx, "test": test_idx}[split]
    rng = random.Random(seed * 1000 + (split == "test"))
    other = random.Random(seed * 1000 + (split == "test") + 7_919)  # the JSON's extra captions: rng's draws unchanged
    for index in chosen:
        label = int(digits.target[index])
        phrasing = rng.choice(CAPTION_PHRASINGS)
        caption = phrasing.format(word=CLASS_NAMES[label], num=label)
        recaption = other.choice(CAPTION_PHRASINGS).format(word=CLASS_NAMES[label], num=label)
        wrong = other.sample([digit for digit in range(10) if digit != label], NEGATIVES)
        negatives = [other.choice(CAPTION_PHRASINGS).format(word=CLASS_NAMES[digit], num=digit) for digit in wrong]
        yield Sample(
            image=encode_png(_upscale(digits.images[index])),
            ext="png",
            caption=caption,
            meta={"label": label, "source_index": int(index), "recaption": recaption, "negatives": negatives},
        )


def ensure_digits(cache_dir: str | os.PathLike) -> dict[str, str]:
    """Build the digit shards under ``cache_dir/digits-v<N>`` unless present; return the brace
    patterns ``{"train": ..., "test": ...}``. Safe to call from several ranks at once."""
    from filelock import FileLock

    root = Path(os.path.expanduser(str(cache_dir))) / f"digits-v{VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / "manifest.json"
    with FileLock(str(root / ".lock")):
        if not manifest.exists():
            log.info("building the embedded digits shards in %s (first use)", root)
            patterns = {
                split: shard_pattern(write_shards(digit_samples(split), root, split, per_shard=500))
                for split in ("train", "test")
            }
            manifest.write_text(json.dumps({k: Path(v).name for k, v in patterns.items()}))
    return {split: str(root / name) for split, name in json.loads(manifest.read_text()).items()}
