"""Our zero-shot predictions equal PyPI's clip-benchmark on the same model, data, class names and
templates (clip-benchmark installs with --no-deps on the CPU; its zero-shot module needs no more)."""

from __future__ import annotations

import pytest
import torch

from megabatch.data.transforms import eval_transform
from megabatch.eval.datasets import eval_batches, resolve_eval_set
from megabatch.eval.zeroshot import build_classifier
from megabatch.models import build_model

from ..helpers import compose

zeroshot = pytest.importorskip("clip_benchmark.metrics.zeroshot_classification")


def test_predictions_equal_clip_benchmark(data_cache):
    cfg = compose()
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    tokenize = model.tokenizer()
    classnames, templates = resolve_eval_set(cfg.eval.digits)
    batches = [(images, labels) for images, (labels, _) in
               eval_batches(cfg.eval.digits, cfg.data, eval_transform(model.preprocess), len(classnames))]
    device = torch.device("cpu")

    ours = build_classifier(model, tokenize, classnames, templates, device)
    our_predictions = torch.cat([(model.encode_image(images) @ ours).argmax(1) for images, _ in batches])

    # clip-benchmark takes the device as a string (it passes it to torch.autocast)
    theirs = zeroshot.zero_shot_classifier(model, tokenize, classnames,
                                           [t.replace("{}", "{c}") for t in templates], "cpu", amp=False)
    logits, targets = zeroshot.run_classification(model, theirs, batches, "cpu", amp=False)
    assert len(our_predictions) == 360
    assert torch.equal(our_predictions, logits.argmax(1))
    assert torch.equal(targets, torch.cat([labels for _, labels in batches]))
    assert len(set(our_predictions.tolist())) > 1  # not a degenerate constant prediction
