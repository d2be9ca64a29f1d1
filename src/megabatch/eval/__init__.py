"""Zero-shot evaluation."""

from .zeroshot import build_classifier, evaluate_zeroshot, run_zeroshot

__all__ = ["build_classifier", "evaluate_zeroshot", "run_zeroshot"]
