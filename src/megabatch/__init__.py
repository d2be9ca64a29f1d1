"""megabatch: CLIP training with contrastive batches of a million samples and more."""

__version__ = "0.1.0"
