"""Captioning evaluation (``eval.<name>.task=captioning``, CLIP_benchmark's ``captioning`` task): a CoCa's
captions of a set's images (``models/generate.py``: beam search or sampling), scored against each image's
reference captions with BLEU-1..4 and CIDEr (COCO's CIDEr-D), x 100 as COCO's leaderboard writes them.

The scorers are pycocoevalcap's ``Bleu`` and ``Cider``, which are pure Python. Its tokenizer runs Java's
Stanford PTBTokenizer; ``ptb_tokens`` does the same here in Python (lower case, words split from punctuation and
contractions, pycocoevalcap's punctuation tokens dropped), so no Java is needed. Without pycocoevalcap
(``pip install pycocoevalcap``) the task is a config error that says so.

The images and references are those of a retrieval set: ``eval.<name>.jsonl`` rows ``{"image": ..., "captions":
[...]}`` or ``eval.<name>.urls`` shards (their ``json`` ``captions`` list, else their ``txt``).
"""

from __future__ import annotations

import re

import torch

from ..config import ConfigError

# pycocoevalcap's PTB punctuation tokens (dropped after tokenizing), as its tokenizer drops them
PUNCTUATION = {"''", "'", "``", "`", "-lrb-", "-rrb-", "-lcb-", "-rcb-", ".", "?", "!", ",", ":", "-", "--", "...",
               ";", "(", ")", "{", "}", "[", "]", '"'}
_TOKEN = re.compile(r"n't\b|'(?:s|re|ve|ll|d|m)\b|\.\.\.|--|[a-z0-9]+(?:[-./][a-z0-9]+)*|[^\sa-z0-9]")


def ptb_tokens(text: str) -> str:
    """``text`` as the PTB tokenizer leaves it for the scorers: lower case, tokens split by spaces, punctuation
    left out (``"A dog's toy, outside."`` -> ``"a dog 's toy outside"``)."""
    text = text.lower().replace("\n", " ")
    text = re.sub(r"([a-z])(n't)\b", r"\1 \2", text)
    return " ".join(token for token in _TOKEN.findall(text) if token not in PUNCTUATION)


def scorers():
    """pycocoevalcap's BLEU and CIDEr scorers, or a ConfigError naming the package."""
    try:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
    except ImportError as error:
        raise ConfigError("task=captioning scores BLEU and CIDEr with pycocoevalcap (pure Python; its Java parts "
                          f"are not used), which is not installed ({error}): pip install pycocoevalcap") from None
    return Bleu(4), Cider()


def caption_scores(references: list[list[str]], candidates: list[str]) -> dict[str, float]:
    """BLEU-1..4 and CIDEr (x 100) of ``candidates[i]`` against ``references[i]`` (one or more each), over
    the whole set, as pycocoevalcap computes them after PTB tokenization."""
    if len(references) != len(candidates) or not candidates:
        raise ValueError(f"{len(candidates)} captions for {len(references)} images")
    bleu, cider = scorers()
    gts = {i: [ptb_tokens(text) for text in texts] for i, texts in enumerate(references)}
    res = {i: [ptb_tokens(text)] for i, text in enumerate(candidates)}
    bleus, _ = bleu.compute_score(gts, res, verbose=0)
    cider_score, _ = cider.compute_score(gts, res)
    return {**{f"bleu{n}": 100.0 * float(value) for n, value in enumerate(bleus, start=1)},
            "cider": 100.0 * float(cider_score)}


@torch.no_grad()
def run_captioning(model, eval_cfg, transform, device, ranks=None) -> dict[str, float]:
    """Caption every image of the set (``eval_cfg.batch_size`` at a time, beam search) and score the captions
    against its references. With several ranks each captions every world-th image; a model sharded by FSDP
    captions the whole set on every rank together (beam search runs as many passes as its captions need, which
    differ between the ranks' images)."""
    from ..models.generate import caption_texts
    from .ranks import Ranks, batched, progress
    from .retrieval import pairs_of

    key = f"eval.{eval_cfg.name}"
    if not getattr(model, "has_decoder", False):
        raise ConfigError(f"{key}.task=captioning needs a model with a caption decoder (model.decoder.layers=2, or "
                          f"a CoCa: model=tiny_coca, or model=openclip model.arch=coca_ViT-B-32); "
                          f"{getattr(model, 'name', 'this model')} has none")
    scorers()  # before the captions are generated: a missing package is said at once
    ranks = ranks if ranks is not None and not ranks.lockstep else Ranks()
    images, captions, owner, load = pairs_of(eval_cfg, transform)
    references: list[list[str]] = [[] for _ in images]
    for text, index in zip(captions, owner.tolist(), strict=True):
        references[index].append(text)
    chunks = list(batched(ranks.take(images), eval_cfg.batch_size))
    generated: list[str] = []
    for chunk in progress(chunks, ranks, f"eval {eval_cfg.name} captions"):
        generated += caption_texts(model, torch.stack([load(item) for item in chunk]).to(device),
                                   max_len=model.context_length)
    return {**caption_scores(references, ranks.interleave_list(generated)), "samples": len(images)}
