"""Image-text retrieval: Recall@K in both directions, computed in chunks.

Only one ``chunk x N`` block of similarities exists at a time, so 5k images x 25k captions (COCO)
never builds the full matrix on the host.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from PIL import Image

from ..config import ConfigError

log = logging.getLogger(__name__)


def load_pairs(jsonl: str | None, key: str = "eval.retrieval") -> tuple[list[Path], list[str], torch.Tensor]:
    """Rows ``{"image": path, "captions": [...]}`` (or ``"caption": str``) -> image paths, all
    captions, and for each caption the index of its image. ``key``: the set's config key, for errors."""
    if not jsonl:
        raise ConfigError(f"{key} needs {key}.jsonl (a JSONL of pairs) or {key}.urls (shards)")
    path = Path(jsonl).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}.jsonl={jsonl!r} does not exist")
    images, captions, owner = [], [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        texts = row.get("captions") or [row["caption"]]
        image = Path(row["image"])
        images.append(image if image.is_absolute() else path.parent / image)
        captions.extend(texts)
        owner.extend([len(images) - 1] * len(texts))
    return images, captions, torch.tensor(owner)


def load_pairs_from_shards(urls: str | list[str], transform, key: str = "eval.retrieval",
                           lines: bool = False) -> tuple[list, list[str], torch.Tensor]:
    """Image tensors, captions and caption owners from webdataset shards: the captions of a sample
    are its ``json`` ``captions`` list when present, else its ``txt`` (``lines``: each line of it a caption,
    as CLIP_benchmark's retrieval sets write them)."""
    import webdataset as wds

    from ..data.samples import Stats, decode_pair
    from ..data.urls import expand_urls

    stats, images, captions, owner = Stats(), [], [], []
    for raw in wds.tarfile_to_samples(handler=stats.handler)(
            iter({"url": u} for u in expand_urls(urls, f"{key}.urls"))):
        pair = decode_pair(raw, stats)
        if pair is None:
            continue
        texts = json.loads(raw["json"]).get("captions") if "json" in raw else None
        if lines and not texts:
            texts = [line.strip() for line in raw["txt"].decode("utf-8").splitlines() if line.strip()]
        texts = texts or [pair[2]]
        images.append(transform(pair[1]))
        captions.extend(texts)
        owner.extend([len(images) - 1] * len(texts))
    return images, captions, torch.tensor(owner)


def pairs_of(eval_cfg, transform) -> tuple[list, list[str], torch.Tensor, Callable]:
    """A retrieval (or captioning) set's images, captions, caption owners and the function giving an image's
    tensor: ``eval.<name>.urls`` or ``format=clip_benchmark`` (shards: images decoded and transformed as read)
    or ``eval.<name>.jsonl`` (paths, opened when encoded)."""
    key = f"eval.{eval_cfg.name}"
    decoded = lambda item: item  # noqa: E731 - read from shards: already a tensor
    shards = _shard_source(eval_cfg)
    if shards is not None:
        return *load_pairs_from_shards(shards[0], transform, key, lines=shards[1]), decoded
    return *load_pairs(eval_cfg.jsonl, key), lambda path: transform(Image.open(path).convert("RGB"))


@torch.no_grad()
def recall_at_k(
    image_features: torch.Tensor, text_features: torch.Tensor, text_to_image: torch.Tensor,
    ks: Sequence[int] = (1, 5, 10), chunk: int = 1024,
) -> dict[str, float]:
    """R@K (%) for image->text (an image is a hit if any of its captions is in its top K) and
    text->image. ``image_features [N, e]``, ``text_features [M, e]`` normalised;
    ``text_to_image [M]`` the image index of each caption."""
    k_max = max(ks)
    text_to_image = text_to_image.to(image_features.device)
    hits_i2t = {k: 0 for k in ks}
    for start in range(0, image_features.shape[0], chunk):
        block = image_features[start : start + chunk] @ text_features.T  # [chunk, M]
        top = block.topk(min(k_max, block.shape[1]), dim=1).indices
        owners = text_to_image[top]  # [chunk, k]
        rows = torch.arange(start, start + block.shape[0], device=block.device)[:, None]
        for k in ks:
            hits_i2t[k] += int((owners[:, :k] == rows).any(dim=1).sum())
    hits_t2i = {k: 0 for k in ks}
    for start in range(0, text_features.shape[0], chunk):
        block = text_features[start : start + chunk] @ image_features.T  # [chunk, N]
        top = block.topk(min(k_max, block.shape[1]), dim=1).indices
        truth = text_to_image[start : start + block.shape[0], None]
        for k in ks:
            hits_t2i[k] += int((top[:, :k] == truth).any(dim=1).sum())
    result = {f"image_to_text_R@{k}": 100.0 * hits_i2t[k] / image_features.shape[0] for k in ks}
    result.update({f"text_to_image_R@{k}": 100.0 * hits_t2i[k] / text_features.shape[0] for k in ks})
    return result


def shard_captions(urls: list[str], lines: bool) -> tuple[list[str], list[int]]:
    """Every caption of a retrieval set's shards and the index of its sample, read without decoding an image:
    a sample's ``json`` ``captions`` list when present, else its ``txt`` (``lines``: each line a caption)."""
    import webdataset as wds

    captions, owner = [], []
    for index, raw in enumerate(wds.tarfile_to_samples(handler=wds.warn_and_continue)(iter({"url": u}
                                                                                         for u in urls))):
        try:
            texts = json.loads(raw["json"]).get("captions") if "json" in raw else None
        except ValueError:
            texts = None
        if not texts and raw.get("txt"):
            text = raw["txt"].decode("utf-8", errors="replace")
            texts = [line.strip() for line in text.splitlines() if line.strip()] if lines else [text]
        captions.extend(texts or [])
        owner.extend([index] * len(texts or []))
    return captions, owner


def _shard_source(eval_cfg) -> tuple[list[str], bool] | None:
    """A retrieval set's shards (and whether each ``txt`` line is a caption), or ``None`` for a jsonl."""
    from ..data.urls import expand_urls

    if eval_cfg.format == "clip_benchmark":
        from . import clip_benchmark

        clip_benchmark.check_task(eval_cfg)
        return clip_benchmark.shard_urls(eval_cfg), True
    return (expand_urls(eval_cfg.urls, f"eval.{eval_cfg.name}.urls"), False) if eval_cfg.urls else None


@torch.no_grad()
def run_retrieval(model, tokenize: Callable, eval_cfg, transform, device, ranks=None) -> dict[str, float]:
    """Encode the pairs of ``eval.jsonl`` (or of the shards ``eval.urls``) in batches and compute
    Recall@K both ways; with several ranks each encodes every world-th image and caption. Images are opened
    and transformed by ``eval.<name>.num_workers`` loader workers."""
    from .datasets import labelled_images, mapped_images
    from .ranks import Ranks, batched, progress

    ranks = ranks or Ranks()
    batch, workers, name = eval_cfg.batch_size, eval_cfg.num_workers, eval_cfg.name
    shards = _shard_source(eval_cfg)
    if shards is None:
        paths, captions, owner = load_pairs(eval_cfg.jsonl, f"eval.{name}")
        load = lambda path: transform(Image.open(path).convert("RGB"))  # noqa: E731
        image_batches = ((images, None) for images in mapped_images(ranks.take(paths), load, batch, workers))
        image_features = ranks.interleave(ranks.features(model.encode_image, progress(
            image_batches, ranks, f"eval {name} images", -(-len(paths) // batch // ranks.world)), device))
    else:  # the captions first (no image decoded), then each rank's images by its loader workers
        captions, samples = shard_captions(*shards)
        mine, places = [], []
        for features, (_, indices) in ranks.encode(model.encode_image, progress(labelled_images(
                shards[0], transform, batch, ranks, workers=workers, labelled=False), ranks, f"eval {name} images"),
                device):
            mine.append(features.float())
            places.append(indices)
        place = torch.cat(places) if places else torch.zeros(0, dtype=torch.long)
        image_features = ranks.in_order(torch.cat(mine) if mine else torch.zeros((0, 0), device=device), place)
        present = torch.cat([p for p in ranks.gather(place)]).sort().values.tolist()
        captioned = set(samples)
        keep = [row for row, sample in enumerate(present) if sample in captioned]  # images with a caption
        row_of = {present[row]: new for new, row in enumerate(keep)}
        image_features = image_features[torch.tensor(keep, dtype=torch.long, device=image_features.device)]
        kept = [i for i, sample in enumerate(samples) if sample in row_of]  # captions of a decoded image
        if len(kept) < len(captions) or len(keep) < len(present):
            log.warning("eval.%s: %d captions without a readable image and %d images without a caption left out",
                        name, len(captions) - len(kept), len(present) - len(keep))
        captions, owner = [captions[i] for i in kept], torch.tensor([row_of[samples[i]] for i in kept])
    if len(image_features) == 0 or not captions:
        raise ConfigError(f"eval.{name}: no image with a caption in the set")
    text_batches = ((tokenize(chunk), None) for chunk in batched(ranks.take(captions), batch))
    text_features = ranks.interleave(ranks.features(model.encode_text, text_batches, device))
    result = recall_at_k(image_features, text_features, owner, chunk=eval_cfg.chunk)
    return {**result, "samples": len(image_features)}
