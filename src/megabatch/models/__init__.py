"""Model builders over open_clip (no re-implemented towers)."""

from .clip import ClipModel, build_clip, build_model
from .openclip import build_openclip, from_description
from .preprocess import build_tokenizer

__all__ = ["ClipModel", "build_clip", "build_model", "build_openclip", "build_tokenizer", "from_description"]
