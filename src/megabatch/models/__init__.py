"""Model builders over open_clip (no re-implemented towers)."""

from .clip import ClipModel, build_clip, build_tokenizer

__all__ = ["ClipModel", "build_clip", "build_tokenizer"]
