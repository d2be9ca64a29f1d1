"""Linear and few-shot probes (``eval.<name>.task=linear_probe``, CLIP_benchmark's ``linear_probe``): a linear
classifier on the frozen image tower's normalised features.

The protocol is CLIP_benchmark's (after CLIP's appendix A.3, with AdamW in place of L-BFGS):
- features of the train, validation and test splits, encoded once (by every rank together, each its share);
- ``eval.<name>.fewshot=k``: k random training images a class (a class with fewer is an error), else all;
- the weight decay searched on the validation split over ``logspace(-6, 2, 97)``: seven values first, then the
  best one's neighbours at 8, 4, 2 and 1 steps of that grid (each round's classifiers shared out over the ranks);
- the classifier for the chosen weight decay trained again on train + validation (only the k shots when
  few-shot) and scored on the test split: top-1, top-5, mean per-class recall, in %.
Each classifier: ``nn.Linear`` from a seeded start, AdamW (``probe_lr``, default 0.1), a cosine schedule over
``probe_epochs`` (10) of ``probe_batch_size`` (64) features, on the evaluation's device.

The validation split is the set's own (a CLIP_benchmark folder's ``val/``, ``eval.<name>.val_urls``) or a
seeded random ``val_proportion`` (0.2) of the training split; ``val_proportion=0`` trains without a search
(weight decay 0), as CLIP_benchmark does without a validation split.

Features are kept on disk (``cache``: ``scripts/evaluate.py`` keeps them beside the checkpoint, in
``<ckpt>.features/``), per checkpoint, weights and set, with what they were computed from; a second probe of the
same checkpoint (another ``fewshot``, another ``probe_lr``) reads them instead of encoding again.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..runtime.files import replace_whole
from .ranks import Ranks, progress

log = logging.getLogger(__name__)

WEIGHT_DECAYS = np.logspace(-6, 2, num=97).tolist()  # CLIP_benchmark's grid
FIRST = [0, 16, 32, 48, 64, 80, 96]                 # its seven starting points: 1e-6, 1e-5 ... 1e2


def search_weight_decay(score: Callable[[float], float], ranks: Ranks | None = None) -> tuple[int, dict[int, float]]:
    """The index in ``WEIGHT_DECAYS`` of the best validation score (``score(weight_decay)``): the best of the
    seven starting points, then of it and its neighbours at 8, 4, 2 and 1 grid steps; the first on ties. Each
    value is scored once, the values of a round shared out over the ``ranks``. Returns the index and every
    scored index's score."""
    ranks = ranks or Ranks()
    scores: dict[int, float] = {}

    def best(indices: list[int]) -> int:
        todo = [index for index in dict.fromkeys(indices) if index not in scores]
        for part in ranks.gather({index: score(WEIGHT_DECAYS[index]) for index in ranks.take(todo)}):
            scores.update(part)
        return max(indices, key=lambda index: (scores[index], -indices.index(index)))

    peak, span = best(FIRST), 8
    while span > 0:
        peak = best([max(peak - span, 0), peak, min(peak + span, len(WEIGHT_DECAYS) - 1)])
        span //= 2
    return peak, scores


def train_classifier(features: torch.Tensor, labels: torch.Tensor, classes: int, weight_decay: float, lr: float,
                     epochs: int, batch_size: int, seed: int) -> torch.nn.Linear:
    """A linear classifier on ``features`` (on their device): AdamW, cosine schedule, cross-entropy, shuffled
    batches, all seeded by ``seed`` (the process's random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Linear(features.shape[1], classes).to(features.device)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    per_epoch = math.ceil(len(features) / batch_size)
    steps = epochs * per_epoch
    with torch.enable_grad():  # evaluation runs without a graph; this training needs one
        _fit(model, optimizer, features, labels, generator, epochs, batch_size, lr, steps)
    return model


def _fit(model, optimizer, features, labels, generator, epochs: int, batch_size: int, lr: float, steps: int) -> None:
    step = 0
    for _ in range(epochs):
        order = torch.randperm(len(features), generator=generator).to(features.device)
        for start in range(0, len(features), batch_size):
            for group in optimizer.param_groups:
                group["lr"] = 0.5 * (1 + math.cos(math.pi * step / steps)) * lr
            rows = order[start:start + batch_size]
            loss = F.cross_entropy(model(features[rows]), labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1


def classification_scores(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1, top-5 (with 5 classes or more) and the mean per-class recall, in %."""
    result = {"lp_top1": 100.0 * (logits.argmax(dim=1) == labels).double().mean().item()}
    if logits.shape[1] >= 5:
        top5 = logits.topk(5, dim=1).indices
        result["lp_top5"] = 100.0 * (top5 == labels[:, None]).any(dim=1).double().mean().item()
    predicted = logits.argmax(dim=1)
    recalls = [(predicted[labels == c] == c).double().mean().item() for c in labels.unique().tolist()]
    result["lp_mean_per_class_recall"] = 100.0 * sum(recalls) / len(recalls)
    return result


def fewshot_indices(labels: torch.Tensor, k: int | None, seed: int, key: str) -> torch.Tensor:
    """The training rows used: all (``k`` None), or the first ``k`` of each class in a seeded random order."""
    if k is None:
        return torch.arange(len(labels))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    taken: dict[int, int] = {}
    rows = []
    for row in order.tolist():
        label = int(labels[row])
        if taken.get(label, 0) < k:
            taken[label] = taken.get(label, 0) + 1
            rows.append(row)
    short = {label: count for label, count in taken.items() if count < k}
    if short:
        label, count = next(iter(short.items()))
        raise ConfigError(f"{key}.fewshot={k}: class {label} has {count} training images (and {len(short)} classes "
                          f"fewer than {k}); lower {key}.fewshot")
    return torch.tensor(sorted(rows))


def probe(splits: dict[str, tuple[torch.Tensor, torch.Tensor]], eval_cfg, device, ranks: Ranks | None = None,
          scores: Callable[[torch.Tensor, torch.Tensor], dict[str, float]] | None = None) -> dict[str, float]:
    """The probe on features ``{"train", "val" (optional), "test": (features, labels)}``: the weight-decay
    search on val (its classifiers shared out over the ranks, by top-1), the final classifier on train (+ val), its
    test scores (``scores(logits, labels)``: ``classification_scores``, or the dense probe's)."""
    scores = scores or classification_scores
    key = f"eval.{eval_cfg.name}"
    seed, k = eval_cfg.probe_seed, eval_cfg.fewshot
    train, test = splits["train"], splits["test"]
    rows = fewshot_indices(train[1], k, seed, key)
    train = (train[0][rows], train[1][rows])
    classes = int(max(int(train[1].max()), int(test[1].max())) + 1)
    fit = lambda data, wd: train_classifier(data[0].to(device), data[1].to(device), classes, wd,  # noqa: E731
                                            eval_cfg.probe_lr, eval_cfg.probe_epochs, eval_cfg.probe_batch_size, seed)
    searched, weight_decay = {}, 0.0
    if "val" in splits:
        val = splits["val"]

        def val_top1(wd: float) -> float:
            with torch.no_grad():
                logits = fit(train, wd)(val[0].to(device)).float().cpu()
            return classification_scores(logits, val[1])["lp_top1"]

        index, searched = search_weight_decay(val_top1, ranks)
        weight_decay = WEIGHT_DECAYS[index]
        if k is None:  # all the data: the final classifier sees train and validation (CLIP_benchmark)
            train = (torch.cat([train[0], val[0]]), torch.cat([train[1], val[1]]))
    with torch.no_grad():
        logits = fit(train, weight_decay)(test[0].to(device)).float().cpu()
    return {**scores(logits, test[1]), "weight_decay": weight_decay,
            "fewshot_k": float(k if k is not None else -1), "weight_decays_tried": float(len(searched)),
            "train_samples": float(len(train[1])), "samples": len(test[1])}


def split_names(eval_cfg) -> dict[str, str | None]:
    """``{"train": split, "val": split or None, "test": split}`` of the set as stored (None: no validation split:
    one is drawn from train)."""
    if eval_cfg.format == "clip_benchmark":
        from . import clip_benchmark

        val = eval_cfg.val_split or ("val" if clip_benchmark.has_split(eval_cfg, "val") else None)
        return {"train": eval_cfg.train_split, "val": val, "test": None}
    if eval_cfg.format == "folder":
        return {"train": eval_cfg.train_split, "val": eval_cfg.val_split, "test": eval_cfg.split}
    return {"train": "train", "val": "val" if eval_cfg.val_urls else None, "test": None}


@torch.no_grad()
def encode_split(model, eval_cfg, data_cfg, transform, device, ranks: Ranks, split: str | None, what: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [n, e] normalised, float32 on the CPU; labels [n])`` of one split, in the split's order."""
    from .datasets import eval_batches

    batches = eval_batches(eval_cfg, data_cfg, transform, 0, ranks, split=split)
    features, labels, places = [], [], []
    for encoded, (label, indices) in ranks.encode(model.encode_image,
                                                  progress(batches, ranks, f"probe {eval_cfg.name} {what}"), device):
        features.append(F.normalize(encoded.float(), dim=-1).cpu())
        labels.append(label)
        places.append(indices)
    where = torch.cat(places) if places else torch.zeros(0, dtype=torch.long)
    mine_features = torch.cat(features) if features else torch.zeros((0, 0))
    mine_labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
    return ranks.in_order(mine_features, where), ranks.in_order(mine_labels, where)


def cache_key(eval_cfg, split: str, stored: str | None) -> dict:
    """What a split's features are computed from, beside the checkpoint: kept with them and compared."""
    return {"set": eval_cfg.name, "format": eval_cfg.format, "root": eval_cfg.root,
            "urls": eval_cfg.urls if split == "test" else getattr(eval_cfg, f"{split}_urls", None), "split": stored,
            "version": 1}


def features_of(model, eval_cfg, data_cfg, transform, device, ranks: Ranks, cache: str | None
                ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], bool]:
    """Every split's features (from ``cache`` where they were kept with the same key), and whether all came
    from the cache."""
    names = split_names(eval_cfg)
    splits, cached = {}, True
    for what, stored in names.items():
        if what == "val" and stored is None:
            continue
        path = Path(cache) / f"{eval_cfg.name}-{what}.pt" if cache else None
        key = cache_key(eval_cfg, what, stored)
        if path is not None and path.is_file():
            kept = torch.load(path, map_location="cpu", weights_only=True)
            if json.loads(kept["key"]) == key:
                splits[what] = (kept["features"], kept["labels"])
                continue
            log.info("features in %s were computed from other data (%s): encoding again", path, kept["key"])
        cached = False
        splits[what] = encode_split(model, eval_cfg, data_cfg, transform, device, ranks, stored, what)
        if path is not None and ranks.main:
            record = {"features": splits[what][0], "labels": splits[what][1], "key": json.dumps(key)}
            replace_whole(path, lambda partial, record=record: torch.save(record, partial))
    hold_out(splits, eval_cfg)
    return splits, cached


def hold_out(splits: dict[str, tuple[torch.Tensor, torch.Tensor]], eval_cfg) -> None:
    """Where ``splits`` has no ``val``: a seeded share (``val_proportion``, by ``probe_seed``) of ``train``'s rows
    becomes it, in place (the rows keep their order)."""
    if "val" in splits or eval_cfg.val_proportion <= 0:
        return
    features, labels = splits["train"]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(eval_cfg.probe_seed))
    held = max(1, round(eval_cfg.val_proportion * len(labels)))
    val, train = order[:held].sort().values, order[held:].sort().values
    splits["val"], splits["train"] = (features[val], labels[val]), (features[train], labels[train])


def run_linear_probe(model, eval_cfg, data_cfg, transform, device, ranks: Ranks | None = None,
                     cache: str | None = None) -> dict[str, float]:
    """The probe of one set: features (cached or encoded by every rank), then the classifier (every rank
    computes the same; rank 0 reports)."""
    import time

    ranks = ranks or Ranks()
    started = time.perf_counter()
    splits, cached = features_of(model, eval_cfg, data_cfg, transform, device, ranks, cache)
    encoded = time.perf_counter()
    for what, (features, _) in splits.items():
        if len(features) == 0:
            raise ConfigError(f"eval.{eval_cfg.name}: the linear probe's {what} split holds no labelled image")
    result = probe(splits, eval_cfg, device, ranks)
    if ranks.main:
        log.info("probe %s: features %s in %.1f s, %d classifiers in %.1f s", eval_cfg.name,
                 "read from " + str(cache) if cached else "encoded", encoded - started,
                 int(result["weight_decays_tried"]) + 1, time.perf_counter() - encoded)
    return {**result, "features_cached": float(cached)}
