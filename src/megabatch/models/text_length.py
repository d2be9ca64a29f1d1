"""Text at its own length: encode captions only up to their last token, not the padding after it.

A CLIP text tower pads every caption to its context (77 tokens), though LAION and CC12M captions
average 15-20 tokens. Where the pooled feature cannot depend on the padding, cutting it off
changes no feature (beyond the kernels' rounding) and saves most of the text tower's work:

- open_clip's own text towers (``CLIP``, ``TextTransformer``): a causal mask, or a padding mask,
  with the feature pooled at the end-of-text token (``argmax``, ``eos``) or the first token. A
  token attends only to those before it (causal) or to non-padding tokens, so padding after the
  last token changes nothing that is pooled. ``last`` and ``avg`` pooling read the padding:
  those towers (SigLIP's, CLIPA's) keep their whole context, as do CoCa's (its class token sits
  after the padding).
- Hugging Face towers: their attention mask (``pad_token_id``) hides the padding from every token
  and their poolers alike.

``TextTrim`` finds a caption's length from its token ids (the position after its last non-padding
token: a tokenizer that pads on the left leaves nothing to cut) and rounds lengths up to multiples
of ``step`` tokens, so a compiled tower sees a few shapes, not one per length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from open_clip.hf_model import HFTextEncoder
from open_clip.model import CLIP
from open_clip.transformer import TextTransformer, text_global_pool

POOLS_BEFORE_PADDING = ("argmax", "eos", "first")  # pooled at a token before the padding


@dataclass(frozen=True)
class TextTrim:
    """How a tower's captions are cut: ``pad_id`` fills a caption after its last token,
    ``context_length`` is the tower's full length, lengths round up to multiples of ``step``."""

    pad_id: int
    context_length: int
    step: int = 8

    def lengths(self, texts: torch.Tensor) -> torch.Tensor:
        """``texts [b, ctx]`` -> each caption's length ``[b]``: one past its last non-padding token
        (0 for a caption of padding only). Computed where ``texts`` lives: on the host, no sync."""
        content = texts != self.pad_id
        last = content.shape[1] - content.flip(1).int().argmax(1)
        return torch.where(content.any(1), last, torch.zeros_like(last))

    def bucket(self, length: int) -> int:
        """``length`` rounded up to a multiple of ``step``, at least ``step``, at most the context."""
        return min(self.context_length, max(self.step, math.ceil(length / self.step) * self.step))

    def cut(self, texts: torch.Tensor) -> torch.Tensor:
        """``texts`` cut to their longest caption's bucket (contiguous; on the host: no sync)."""
        longest = int(self.lengths(texts).max()) if len(texts) else 0
        return texts[:, :self.bucket(longest)].contiguous()


def text_trim(clip: torch.nn.Module, model_cfg: dict, step: int = 8) -> TextTrim | None:
    """The ``TextTrim`` of ``clip``'s text tower, or ``None`` where its features depend on the
    padding (``why_untrimmed`` says why)."""
    if why_untrimmed(clip) is not None:
        return None
    text = getattr(clip, "text", None)
    if isinstance(text, HFTextEncoder):
        return TextTrim(int(text.config.pad_token_id), int(model_cfg["text_cfg"].get("context_length", 77)), step)
    tower = text if isinstance(text, TextTransformer) else clip
    return TextTrim(int(model_cfg["text_cfg"].get("pad_id", 0)), int(tower.positional_embedding.shape[0]), step)


def why_untrimmed(clip: torch.nn.Module) -> str | None:
    """Why ``clip``'s text features could depend on the padding (``None``: they cannot)."""
    text = getattr(clip, "text", None)
    if isinstance(text, HFTextEncoder):
        return None if text.config.pad_token_id is not None else "the Hugging Face tower has no pad_token_id"
    if isinstance(text, TextTransformer):
        if text.cls_emb is not None:
            return "its class token follows the padding (CoCa)"
        pool, masked = text.pool_type, text.attn_mask is not None or text.use_pad_mask
    elif isinstance(clip, CLIP):
        pool, masked = clip.text_pool_type, clip.attn_mask is not None
    else:
        return f"{type(text or clip).__name__} is not a text tower megabatch knows"
    if pool not in POOLS_BEFORE_PADDING:
        return f"it pools {pool!r}, which reads the padding"
    if not masked:
        return "it has neither a causal nor a padding mask"
    return None


def encode_text_prefix(clip: torch.nn.Module, texts: torch.Tensor) -> torch.Tensor:
    """``clip.encode_text`` of captions cut to ``L <= context`` tokens (unnormalised ``[b, e]``):
    open_clip's towers take their positional embedding and causal mask of full length, so their
    first ``L`` rows and columns are taken here; an HF tower and a padding-masked tower take any
    length as they are."""
    text = getattr(clip, "text", None)
    if isinstance(text, HFTextEncoder) or (isinstance(text, TextTransformer) and text.use_pad_mask):
        return clip.encode_text(texts)
    tower = text if isinstance(text, TextTransformer) else clip
    length = texts.shape[1]
    cast_dtype = tower.transformer.get_cast_dtype()
    x = tower.token_embedding(texts).to(cast_dtype) + tower.positional_embedding[:length].to(cast_dtype)
    # open_clip's causal mask, built at this length (a slice of the full one is not contiguous, and a
    # compiled tower would specialise its dynamic length on that)
    mask = torch.full((length, length), float("-inf"), device=x.device, dtype=tower.attn_mask.dtype).triu(1)
    x = tower.transformer(x, attn_mask=mask)
    x = tower.ln_final(x)
    if tower is clip:
        pool, eos = clip.text_pool_type, getattr(clip, "text_eos_id", None)
    else:
        pool, eos = tower.pool_type, getattr(tower, "eos_id", None)
    x = text_global_pool(x, texts, pool, eos_token_id=eos)
    projection = tower.text_projection
    if projection is None:
        return x
    return projection(x) if isinstance(projection, torch.nn.Linear) else x @ projection
