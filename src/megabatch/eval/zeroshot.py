"""Zero-shot classification: class names x prompt templates -> averaged normalised text
embeddings -> top-1/top-5 on held-out images."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@torch.no_grad()
def build_classifier(
    model,
    tokenize: Callable[[list[str]], torch.Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    device: torch.device,
    batch_classes: int = 64,
) -> torch.Tensor:
    """``[e, n_classes]``: for each class, the normalised mean of its normalised prompt embeddings.

    Prompts are encoded ``batch_classes`` classes at a time (all templates of a class together).
    """
    weights = []
    for start in range(0, len(classnames), batch_classes):
        names = classnames[start : start + batch_classes]
        prompts = [template.format(name) for name in names for template in templates]
        embeddings = model.encode_text(tokenize(prompts).to(device)).float()
        embeddings = embeddings.view(len(names), len(templates), -1).mean(dim=1)
        weights.append(F.normalize(embeddings, dim=-1))
    return torch.cat(weights).T


@torch.no_grad()
def evaluate_zeroshot(
    model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], classifier: torch.Tensor,
    device: torch.device,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy and the mean per-class recall (top-1 recall of each class present, averaged:
    CLIP_benchmark's ``mean_per_class_recall``, scikit-learn's balanced accuracy), in %, of
    ``image_features @ classifier`` over ``batches``."""
    correct1 = correct5 = total = 0
    k = min(5, classifier.shape[1])
    seen = torch.zeros(classifier.shape[1], dtype=torch.long)
    right = torch.zeros(classifier.shape[1], dtype=torch.long)
    for images, labels in batches:
        features = model.encode_image(images.to(device)).float()
        top = (features @ classifier).topk(k, dim=-1).indices.cpu()
        hits = top == labels[:, None]
        correct1 += int(hits[:, 0].sum())
        correct5 += int(hits.any(dim=-1).sum())
        total += len(labels)
        seen += torch.bincount(labels, minlength=len(seen))
        right += torch.bincount(labels[hits[:, 0]], minlength=len(right))
    if total == 0:
        raise ValueError("zero-shot evaluation saw no images")
    present = seen > 0
    recall = (right[present].double() / seen[present]).mean().item()
    return {"top1": 100.0 * correct1 / total, "top5": 100.0 * correct5 / total,
            "mean_per_class_recall": 100.0 * recall, "samples": total}


def run_zeroshot(model, tokenize, eval_cfg, data_cfg, device) -> dict[str, float]:
    """Evaluate ``model`` on one set ``eval_cfg``: zero-shot classification (class names,
    templates, images), image-text retrieval when ``task=retrieval``, a CoCa's captions scored against
    references when ``task=captioning``, hard negatives when ``task=image_caption_selection``. Images are preprocessed
    as the model says (``model.preprocess``: open_clip's evaluation transform)."""
    from ..data.transforms import eval_transform
    from .datasets import eval_batches, resolve_eval_set

    transform = eval_transform(model.preprocess)
    was_training = model.training
    model.eval()
    try:
        if eval_cfg.task == "retrieval":
            from .retrieval import run_retrieval

            return run_retrieval(model, tokenize, eval_cfg, transform, device)
        if eval_cfg.task == "image_caption_selection":
            from .selection import run_selection

            return run_selection(model, tokenize, eval_cfg, transform, device)
        if eval_cfg.task == "captioning":
            from .captioning import run_captioning

            return run_captioning(model, eval_cfg, transform, device)
        classnames, templates = resolve_eval_set(eval_cfg)
        classifier = build_classifier(model, tokenize, classnames, templates, device)
        batches = eval_batches(eval_cfg, data_cfg, transform, len(classnames))
        return evaluate_zeroshot(model, batches, classifier, device)
    finally:
        model.train(was_training)


def weights_to_evaluate(weights: str, has_average: bool) -> list[str]:
    """``eval.<name>.weights`` as the weights to evaluate in turn: ``raw`` (as trained) and/or ``ema``
    (the moving average); ``auto``: both where there is an average, else raw."""
    if weights == "auto":
        return ["raw", "ema"] if has_average else ["raw"]
    return ["raw", "ema"] if weights == "both" else [weights]


def result_name(name: str, weights: str) -> str:
    """A set's name in the logs and result files: ``<name>``, or ``<name>-ema`` for the moving average."""
    return name if weights == "raw" else f"{name}-{weights}"


def headline(result: dict[str, float]) -> float:
    """The one number of a set's result: zero-shot top-1, image-to-text R@1 for retrieval, CIDEr (x 100) for
    captioning, the accuracy (both ways) for image-caption selection."""
    for metric in ("top1", "cider", "acc"):
        if metric in result:
            return result[metric]
    return result["image_to_text_R@1"]


def summary(name: str, result: dict[str, float]) -> str:
    if "top1" in result:
        return (f"zero-shot top-1 on {name} (held out): {result['top1']:.2f}% (top-5 {result['top5']:.2f}%, "
                f"{result['samples']} images)")
    return f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float))
