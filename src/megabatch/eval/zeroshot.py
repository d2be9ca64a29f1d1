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
    """Top-1 / top-5 accuracy (in %) of ``image_features @ classifier`` over ``batches``."""
    correct1 = correct5 = total = 0
    k = min(5, classifier.shape[1])
    for images, labels in batches:
        features = model.encode_image(images.to(device)).float()
        top = (features @ classifier).topk(k, dim=-1).indices.cpu()
        hits = top == labels[:, None]
        correct1 += int(hits[:, 0].sum())
        correct5 += int(hits.any(dim=-1).sum())
        total += len(labels)
    if total == 0:
        raise ValueError("zero-shot evaluation saw no images")
    return {"top1": 100.0 * correct1 / total, "top5": 100.0 * correct5 / total, "samples": total}


def run_zeroshot(model, tokenize, eval_cfg, data_cfg, image_size: int, device) -> dict[str, float]:
    """Evaluate ``model`` on ``eval_cfg``: zero-shot classification (class names, templates,
    images), or image-text retrieval when ``eval.task=retrieval``."""
    from ..data.transforms import eval_transform
    from .datasets import eval_batches, resolve_eval_set

    if eval_cfg.task == "retrieval":
        from .retrieval import run_retrieval

        return run_retrieval(model, tokenize, eval_cfg, eval_transform(image_size), device)

    classnames, templates = resolve_eval_set(eval_cfg)
    was_training = model.training
    model.eval()
    try:
        classifier = build_classifier(model, tokenize, classnames, templates, device)
        batches = eval_batches(eval_cfg, data_cfg, eval_transform(image_size), len(classnames))
        return evaluate_zeroshot(model, batches, classifier, device)
    finally:
        model.train(was_training)
