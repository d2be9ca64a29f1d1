"""Model builders over open_clip (no re-implemented towers)."""

from .deferred_hf import import_open_clip

import_open_clip()  # before the modules below import open_clip: transformers is imported when a tower needs it

from .clip import ClipModel, build_clip, build_model  # noqa: E402
from .openclip import build_openclip, from_description  # noqa: E402
from .preprocess import build_tokenizer  # noqa: E402

__all__ = ["ClipModel", "build_clip", "build_model", "build_openclip", "build_tokenizer", "from_description"]
