"""Zero-shot evaluation."""

from .zeroshot import build_classifier, evaluate_zeroshot, headline, run_zeroshot, summary

__all__ = ["build_classifier", "evaluate_zeroshot", "headline", "run_zeroshot", "summary"]
