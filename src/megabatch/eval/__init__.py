"""Zero-shot evaluation."""

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
