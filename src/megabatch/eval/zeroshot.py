"""Zero-shot classification: class names x prompt templates -> averaged normalised text
embeddings -> top-1/top-5 on held-out images."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..config.run import EvalSetSettings
from ..report.results import headline  # noqa: F401 (eval.headline, as before)
from .ranks import Ranks, batched, progress

log = logging.getLogger(__name__)


@torch.no_grad()
def build_classifier(
    model,
    tokenize: Callable[[list[str]], torch.Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    device: torch.device,
    batch_classes: int = 64,
    ranks: Ranks | None = None,
) -> torch.Tensor:
    """``[e, n_classes]``: for each class, the normalised mean of its normalised prompt embeddings.

    Prompts are encoded ``batch_classes`` classes at a time (all templates of a class together); with several
    ranks each encodes every world-th class.
    """
    ranks = ranks or Ranks()
    mine = ranks.take(list(classnames))

    def prompts(names: list[str]) -> tuple[torch.Tensor, int]:
        return tokenize([template.format(name) for name in names for template in templates]), len(names)

    weights = [F.normalize(embeddings.float().view(count, len(templates), -1).mean(dim=1), dim=-1)
               for embeddings, count in ranks.encode(model.encode_text, map(prompts, batched(mine, batch_classes)),
                                                      device)]
    # a rank with no class (fewer classes than ranks) adds nothing: the width comes from rank 0's rows
    return ranks.interleave(torch.cat(weights) if weights else torch.zeros((0, 0), device=device)).T


class NoImages(ValueError):
    """An evaluation set whose split gave no labelled image."""


@torch.no_grad()
def evaluate_zeroshot(
    model, batches: Iterable[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]], classifier: torch.Tensor,
    device: torch.device, ranks: Ranks | None = None,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy and the mean per-class recall (top-1 recall of each class present, averaged:
    CLIP_benchmark's ``mean_per_class_recall``, scikit-learn's balanced accuracy), in %, of
    ``image_features @ classifier`` over ``batches`` (this rank's, with several: the counts are summed;
    ``(images, (labels, indices))`` as ``eval_batches`` gives them).
    Labels given as ``[n, classes]`` vectors (a multi-label set) give the mean average precision over the
    classes (``mAP``, %, CLIP_benchmark's ``mean_average_precision``) instead."""
    ranks = ranks or Ranks()
    n_classes = classifier.shape[1]
    k = min(5, n_classes)
    counts = {"correct1": 0, "correct5": 0, "total": 0, "seen": torch.zeros(n_classes, dtype=torch.long),
              "right": torch.zeros(n_classes, dtype=torch.long)}
    scores, targets, places = [], [], []
    for features, (labels, indices) in ranks.encode(model.encode_image, batches, device):
        logits = features.float() @ classifier
        if labels.dim() == 2:  # multi-label: every class's score kept for its ranking
            scores.append(logits.cpu())
            targets.append(labels)
            places.append(indices)
            continue
        top = logits.topk(k, dim=-1).indices.cpu()
        hits = top == labels[:, None]
        counts["correct1"] += int(hits[:, 0].sum())
        counts["correct5"] += int(hits.any(dim=-1).sum())
        counts["total"] += len(labels)
        counts["seen"] += torch.bincount(labels, minlength=n_classes)
        counts["right"] += torch.bincount(labels[hits[:, 0]], minlength=n_classes)
    if ranks.gather(bool(scores)) != [False] * ranks.world:
        where = torch.cat(places) if places else torch.zeros(0, dtype=torch.long)
        logits = ranks.in_order(torch.cat(scores) if scores else torch.zeros((0, n_classes)), where)
        truth = ranks.in_order(torch.cat(targets) if targets else torch.zeros((0, n_classes)), where)
        if len(logits) == 0:
            raise NoImages("zero-shot evaluation saw no images")
        return {"mAP": 100.0 * average_precision(logits, truth).mean().item(), "samples": len(logits)}
    counts = ranks.sum(counts)
    total = counts["total"]
    if total == 0:
        raise NoImages("zero-shot evaluation saw no images")
    seen, right = counts["seen"], counts["right"]
    present = seen > 0
    recall = (right[present].double() / seen[present]).mean().item()
    return {"top1": 100.0 * counts["correct1"] / total, "top5": 100.0 * counts["correct5"] / total,
            "mean_per_class_recall": 100.0 * recall, "samples": total}


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[classes]``: each class's average precision of ``scores [n, classes]`` against 0/1 ``targets``: the
    precision at each of its positives, ranked by score, averaged (0 for a class without positives)."""
    order = scores.double().argsort(dim=0, descending=True, stable=True)
    truth = targets.double().gather(0, order)
    precision = truth.cumsum(0) / torch.arange(1, len(scores) + 1, dtype=torch.float64)[:, None]
    return (precision * truth).sum(0) / truth.sum(0).clamp(min=1)


def run_zeroshot(model, tokenize, eval_cfg, data_cfg, device, cache: str | None = None) -> dict[str, float]:
    """Evaluate ``model`` on one set ``eval_cfg``: zero-shot classification (class names,
    templates, images), image-text retrieval when ``task=retrieval``, a CoCa's captions scored against
    references when ``task=captioning``, hard negatives when ``task=image_caption_selection``, a linear
    classifier on the frozen image features when ``task=linear_probe`` (features kept under ``cache`` where
    given), on its patch tokens when ``task=dense_probe``. Images are preprocessed as the model says
    (``model.preprocess``: open_clip's evaluation transform). Under torchrun every rank calls this together: each
    encodes its share of the set (``eval/ranks.py``), and every rank returns the whole set's numbers."""
    from ..data.transforms import eval_transform
    from .datasets import eval_batches, labels_within, resolve_eval_set

    eval_cfg = EvalSetSettings.of(eval_cfg)  # parsed once: everything below reads the typed set
    transform = eval_transform(model.preprocess) if model.naflex is None else naflex_eval_transform(model, eval_cfg)
    ranks = Ranks.of(model)
    was_training = model.training
    model.eval()
    try:
        if eval_cfg.task == "retrieval":
            from .retrieval import run_retrieval

            return run_retrieval(model, tokenize, eval_cfg, transform, device, ranks)
        if eval_cfg.task == "image_caption_selection":
            from .selection import run_selection

            return run_selection(model, tokenize, eval_cfg, transform, device, ranks)
        if eval_cfg.task == "captioning":
            from .captioning import run_captioning

            return run_captioning(model, eval_cfg, transform, device, ranks)
        if eval_cfg.task == "linear_probe":
            from .probe import run_linear_probe

            return run_linear_probe(model, eval_cfg, data_cfg, transform, device, ranks, cache)
        if eval_cfg.task == "dense_probe":
            from .dense import run_dense_probe

            return run_dense_probe(model, eval_cfg, data_cfg, transform, device, ranks)
        classnames, templates = resolve_eval_set(eval_cfg)
        classifier = build_classifier(model, tokenize, classnames, templates, device, ranks=ranks)
        batches = labels_within(eval_batches(eval_cfg, data_cfg, transform, len(classnames), ranks), len(classnames),
                                eval_cfg)
        try:
            return evaluate_zeroshot(model, progress(batches, ranks, f"eval {eval_cfg.name}"), classifier, device,
                                     ranks)
        except NoImages:
            where = eval_cfg.root or eval_cfg.urls or "its data"
            raise ConfigError(f"eval.{eval_cfg.name}: its split holds no labelled image ({where}): check "
                              f"eval.{eval_cfg.name}.root / .urls / .split, or leave the set out") from None
    finally:
        model.train(was_training)


def naflex_eval_transform(model, eval_cfg):
    """A NaFlex tower's evaluation transform: each image with its aspect ratio kept, as ``eval.<name>.seq_len``
    patches (the model's ``max_seq_len`` where unset; any length: the position embeddings are resized per
    image), the model's interpolation (``data/naflex.py``)."""
    from ..data.naflex import NaFlexSpec

    cfg = model.naflex
    if eval_cfg.seq_len is not None and eval_cfg.seq_len < 1:
        raise ConfigError(f"eval.{eval_cfg.name}.seq_len={eval_cfg.seq_len}: give the patches per image (e.g. 256, "
                          "576, 784, 1024), or null (the model's max_seq_len)")
    spec = NaFlexSpec(cfg.patch_size, cfg.max_seq_len, (cfg.max_seq_len,),
                      interpolation=model.preprocess["interpolation"])
    return spec.eval_transform(eval_cfg.seq_len)


def weights_to_evaluate(weights: str, has_average: bool) -> list[str]:
    """``eval.<name>.weights`` as the weights to evaluate in turn: ``raw`` (as trained) and/or ``ema``
    (the moving average); ``auto``: both where there is an average, else raw."""
    if weights == "auto":
        return ["raw", "ema"] if has_average else ["raw"]
    return ["raw", "ema"] if weights == "both" else [weights]


def result_name(name: str, weights: str) -> str:
    """A set's name in the logs and result files: ``<name>``, or ``<name>-ema`` for the moving average."""
    return name if weights == "raw" else f"{name}-{weights}"


def summary(name: str, result: dict[str, float]) -> str:
    if "top1" in result:
        return (f"zero-shot top-1 on {name} (held out): {result['top1']:.2f}% (top-5 {result['top5']:.2f}%, "
                f"{result['samples']} images)")
    return f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float))
