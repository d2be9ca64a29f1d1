"""Image-caption selection (``eval.<name>.task=image_caption_selection``, CLIP_benchmark's task of that name):
compositionality sets such as SugarCrepe (an image, its true caption and hard negatives) and Winoground (two
images, two captions). Each instance's i-th image should be closest to its i-th caption and the reverse:
``text_acc`` (every image picks its caption), ``image_acc`` (every caption picks its image) and ``acc`` (both),
in %, over the set and per ``subset`` where the rows name one (``acc/<subset>``, ...).

``eval.<name>.jsonl`` rows: ``{"image": path, "captions": [true, negative, ...]}`` or ``{"images": [...],
"captions": [...]}`` (the i-th caption describes the i-th image; captions past the images are negatives), with an
optional ``"subset"`` (SugarCrepe's ``replace_obj``, ``swap_att``, ...); paths relative to the file.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from ..config import ConfigError


def load_instances(eval_cfg) -> list[dict]:
    key = f"eval.{eval_cfg.name}"
    if not eval_cfg.jsonl:
        raise ConfigError(f"{key}.task=image_caption_selection needs {key}.jsonl (rows {{\"image\": ..., "
                          "\"captions\": [true, negative, ...]}})")
    path = Path(eval_cfg.jsonl).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}.jsonl={eval_cfg.jsonl!r} does not exist")
    instances = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        images = row.get("images") or ([row["image"]] if "image" in row else [])
        captions = row.get("captions") or []
        if not images or len(captions) < max(2, len(images)):
            raise ConfigError(f"{key}.jsonl={eval_cfg.jsonl!r} line {number}: give an image (or images) and at "
                              "least two captions, the true one(s) first")
        instances.append({"images": [p if Path(p).is_absolute() else str(path.parent / p) for p in images],
                          "captions": list(captions), "subset": row.get("subset")})
    if not instances:
        raise ConfigError(f"{key}.jsonl={eval_cfg.jsonl!r} holds no row")
    return instances


@torch.no_grad()
def run_selection(model, tokenize, eval_cfg, transform, device, ranks=None) -> dict[str, float]:
    """Encode each instance's images and captions (``eval_cfg.batch_size`` instances at a time) and score them;
    with several ranks each takes every world-th instance."""
    from .datasets import mapped_images
    from .ranks import Ranks, batched, progress

    ranks = ranks or Ranks()
    instances = load_instances(eval_cfg)
    mine = ranks.take(instances)
    chunks = list(batched(mine, eval_cfg.batch_size))
    paths = [path for item in mine for path in item["images"]]
    load = lambda path: transform(Image.open(path).convert("RGB"))  # noqa: E731
    image_batches = ((images, None) for images in mapped_images(paths, load, eval_cfg.batch_size,
                                                                eval_cfg.num_workers))
    text_batches = ((tokenize([c for item in chunk for c in item["captions"]]), None) for chunk in chunks)
    images = F.normalize(ranks.features(model.encode_image, progress(image_batches, ranks, f"eval {eval_cfg.name}",
                                                                     -(-len(paths) // eval_cfg.batch_size)), device))
    texts = F.normalize(ranks.features(model.encode_text, text_batches, device))
    outcomes_mine = []
    first_image = first_text = 0
    for item in mine:
        count, captions = len(item["images"]), len(item["captions"])
        scores = images[first_image:first_image + count] @ texts[first_text:first_text + captions].T
        truth = torch.arange(min(count, captions), device=scores.device)
        text_right = bool((scores.argmax(dim=1)[:len(truth)] == truth).all())
        image_right = bool((scores.argmax(dim=0)[:len(truth)] == truth).all())
        outcomes_mine.append((item["subset"], text_right, image_right))
        first_image, first_text = first_image + count, first_text + captions
    outcomes: dict[str | None, list[tuple[bool, bool]]] = defaultdict(list)
    for subset, text_right, image_right in ranks.interleave_list(outcomes_mine):
        outcomes[subset].append((text_right, image_right))

    def accuracies(rows: list[tuple[bool, bool]], suffix: str = "") -> dict[str, float]:
        n = len(rows)
        return {f"text_acc{suffix}": 100.0 * sum(t for t, _ in rows) / n,
                f"image_acc{suffix}": 100.0 * sum(i for _, i in rows) / n,
                f"acc{suffix}": 100.0 * sum(t and i for t, i in rows) / n}

    result = accuracies([row for rows in outcomes.values() for row in rows])
    for subset in sorted(s for s in outcomes if s is not None):
        result.update(accuracies(outcomes[subset], f"/{subset}"))
    return {**result, "samples": len(instances)}

