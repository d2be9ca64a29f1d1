"""A dense probe (``eval.<name>.task=dense_probe``): a linear classifier on the frozen image tower's patch tokens,
segmentation style, for what a tower's patches know of their own place (SigLIP 2's self-distillation and masked
prediction train them: ``objective`` / ``self_distill``).

Any labelled set the linear probe reads serves: its images are laid out ``eval.<name>.mosaic`` a side
(``mosaic=2``: four images, each shrunk to a quarter of the model's input, one scene), and each patch's label is the
class of the image it lies on. The tower's tokens of the scene (after its last layer norm, not projected; the class
token left out) are the features, normalised, one row a patch; the probe is the linear probe's (``eval/probe.py``:
the weight decay searched on a validation split, the classifier trained again on train + validation), scored on the
test split's scenes patch by patch: ``dense_miou`` (the classes' mean intersection over union, the classes of the
labels), ``dense_top1`` (the patches' accuracy) and ``dense_mean_per_class_recall``.

A scene's images are consecutive images of the split (in the set's order; the last ``< mosaic^2`` left out), so
every number of ranks makes the same scenes: each rank reads the whole split and encodes its share of the scenes.
Open_clip ViT image towers (``models/views.py: tower_tokens``); the grid of patches must split into ``mosaic``
equal parts a side. Features are not kept on disk.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .probe import classification_scores, hold_out, probe, split_names
from .ranks import Ranks, progress

log = logging.getLogger(__name__)


def mosaics(images: torch.Tensor, labels: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``images [n, 3, h, w]`` as scenes of ``tile x tile`` of them (row by row, each resized to ``h / tile x w /
    tile``, antialiased): ``[n / tile^2, 3, h, w]`` and each scene's images' labels ``[n / tile^2, tile, tile]``;
    a last ``n mod tile^2`` images are left out."""
    count = len(images) // tile ** 2
    height, width = images.shape[-2:]
    small = F.interpolate(images[:count * tile ** 2].float(), size=(height // tile, width // tile), mode="bilinear",
                          antialias=True, align_corners=False)
    scenes = small.view(count, tile, tile, 3, height // tile, width // tile).permute(0, 3, 1, 4, 2, 5)
    return scenes.reshape(count, 3, tile * (height // tile), tile * (width // tile)).to(images.dtype), \
        labels[:count * tile ** 2].view(count, tile, tile)


def patch_labels(tiles: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``[m, tile, tile]`` scene labels -> ``[m, gh * gw]``: each patch of a ``grid`` the label of its tile."""
    per_h, per_w = grid[0] // tiles.shape[1], grid[1] // tiles.shape[2]
    return tiles.repeat_interleave(per_h, 1).repeat_interleave(per_w, 2).reshape(len(tiles), -1)


def dense_scores(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """The patches' mean intersection over union (over the classes among ``labels``), accuracy and mean per-class
    recall, in %."""
    predicted = logits.argmax(dim=1)
    ious = []
    for c in labels.unique().tolist():
        truth, guess = labels == c, predicted == c
        ious.append((truth & guess).sum().item() / (truth | guess).sum().item())
    plain = classification_scores(logits, labels)
    return {"dense_miou": 100.0 * sum(ious) / len(ious), "dense_top1": plain["lp_top1"],
            "dense_mean_per_class_recall": plain["lp_mean_per_class_recall"]}


def tower(model, key: str):
    """The open_clip ViT image tower whose patch tokens the probe reads, or a ``ConfigError`` naming ``key``."""
    visual = getattr(getattr(model, "clip", None), "visual", None)
    if visual is None or not hasattr(visual, "conv1") or getattr(model, "naflex", None) is not None:
        raise ConfigError(f"{key}.task=dense_probe reads an open_clip ViT image tower's patch tokens; this model's "
                          "image tower is another kind (timm, NaFlex): evaluate it with task=linear_probe, or leave "
                          "the set out")
    return visual


@torch.no_grad()
def encode_scenes(model, eval_cfg, data_cfg, transform, device, ranks: Ranks, split: str | None, what: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [m, patches, width] normalised, float32 on the CPU; labels [m, patches])`` of one split's scenes,
    in the split's order."""
    from ..models.views import tower_tokens
    from .datasets import eval_batches

    key, tile = f"eval.{eval_cfg.name}", eval_cfg.mosaic
    visual = tower(model, key)
    grid = tuple(visual.grid_size)
    if grid[0] % tile or grid[1] % tile:
        raise ConfigError(f"{key}.mosaic={tile}: the tower's {grid[0]} x {grid[1]} patches do not split into {tile} "
                          "equal parts a side; use a divisor of both sides (1: one image a scene)")

    def scenes():  # every rank reads the whole split (its scenes do not depend on the ranks), keeps its share
        pending_images, pending_labels, made = [], [], 0
        for images, (labels, _) in eval_batches(eval_cfg, data_cfg, transform, 0, None, split=split):
            pending_images.append(images)
            pending_labels.append(labels)
            images, labels = torch.cat(pending_images), torch.cat(pending_labels)
            whole = len(images) // tile ** 2 * tile ** 2
            if whole:
                made_here, tiles = mosaics(images[:whole], labels[:whole], tile)
                index = torch.arange(made, made + len(made_here))
                mine = index % ranks.world == ranks.rank
                if mine.any():
                    yield made_here[mine], (tiles[mine], index[mine])
                made += len(made_here)
            pending_images, pending_labels = [images[whole:]], [labels[whole:]]

    features, labels, places = [], [], []
    encode = lambda x: tower_tokens(visual, x)[1]  # noqa: E731
    for tokens, (tiles, indices) in ranks.encode(encode, progress(scenes(), ranks, f"dense {eval_cfg.name} {what}"),
                                                 device):
        if tokens.shape[1] != grid[0] * grid[1]:
            raise ConfigError(f"{key}.task=dense_probe: the image tower's tokens are not its {grid[0]} x {grid[1]} "
                              f"patches ({tokens.shape[1]} of them: attentional pooling, a CoCa's); use "
                              "task=linear_probe")
        features.append(F.normalize(tokens.float(), dim=-1).cpu())
        labels.append(patch_labels(tiles, grid))
        places.append(indices)
    width = getattr(visual, "width", None) or (features[0].shape[-1] if features else 0)
    where = torch.cat(places) if places else torch.zeros(0, dtype=torch.long)
    mine_features = torch.cat(features) if features else torch.zeros((0, grid[0] * grid[1], width))
    mine_labels = torch.cat(labels) if labels else torch.zeros((0, grid[0] * grid[1]), dtype=torch.long)
    return ranks.in_order(mine_features, where), ranks.in_order(mine_labels, where)


def run_dense_probe(model, eval_cfg, data_cfg, transform, device, ranks: Ranks | None = None) -> dict[str, float]:
    """The dense probe of one set: every split's scenes encoded (each rank its share), a validation share of the
    training scenes held out where the set has no validation split, then the linear probe on the patch rows."""
    ranks = ranks or Ranks()
    started = time.perf_counter()
    scenes = {}
    for what, stored in split_names(eval_cfg).items():
        if what == "val" and stored is None:
            continue
        scenes[what] = encode_scenes(model, eval_cfg, data_cfg, transform, device, ranks, stored, what)
        if len(scenes[what][0]) == 0:
            raise ConfigError(f"eval.{eval_cfg.name}: the dense probe's {what} split makes no scene (fewer than "
                              f"{eval_cfg.mosaic ** 2} labelled images)")
    hold_out(scenes, eval_cfg)  # whole scenes, as the linear probe holds out whole images
    encoded = time.perf_counter()
    rows = {what: (features.flatten(0, 1), labels.flatten()) for what, (features, labels) in scenes.items()}
    result = probe(rows, eval_cfg, device, ranks, scores=dense_scores)
    if ranks.main:
        log.info("dense probe %s: %d test scenes encoded in %.1f s, %d classifiers in %.1f s", eval_cfg.name,
                 len(scenes["test"][1]), encoded - started, int(result["weight_decays_tried"]) + 1,
                 time.perf_counter() - encoded)
    return {**result, "scenes": float(len(scenes["test"][1]))}
