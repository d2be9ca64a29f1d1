"""Evaluation: zero-shot classification, retrieval, captioning, image-caption selection and linear probes of a
model on its sets (``eval.<name>``), in training and from a checkpoint (``scripts/evaluate.py``), and their results
tables."""

from .zeroshot import (
    build_classifier,
    evaluate_zeroshot,
    headline,
    result_name,
    run_zeroshot,
    summary,
    weights_to_evaluate,
)

__all__ = ["build_classifier", "evaluate_zeroshot", "headline", "result_name", "run_zeroshot", "summary",
           "weights_to_evaluate"]
