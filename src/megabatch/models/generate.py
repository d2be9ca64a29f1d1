"""Captions from a CoCa's decoder (or ``model.decoder``'s, ``models/decoder.py``): beam search, or top-k / top-p
sampling.

open_clip 3.3's ``CoCa.generate`` asserts on transformers' ``BeamSearchScorer``, which transformers 5 no
longer has (our pinned version), for every generation type; this is the same decoding on open_clip's own
forward pass (``CoCa.forward(image, text, image_latent, image_embs, output_labels=False)``), without
transformers.
"""

from __future__ import annotations

import torch

METHODS = ("beam_search", "top_k", "top_p")


def caption_texts(model, images: torch.Tensor, method: str = "beam_search", max_len: int = 30) -> list[str]:
    """Each image's caption as text, from a ``ClipModel`` with a decoder (a CoCa) on ``images`` (normalised, on
    its device): its tokenizer's start, end and pad tokens, at most ``max_len`` tokens (and what its context
    leaves after the start token and CoCa's class token)."""
    tokenizer = model.tokenizer()
    decoder = getattr(model, "decoder", None)
    if decoder is not None:  # model.decoder's captioner, seen as a CoCa (models/decoder.py)
        from .decoder import DecoderCaptioner

        target, pad = DecoderCaptioner(model), decoder.pad_id
    else:
        target, pad = model.clip, model.clip.pad_id
    rows = generate_captions(target, images, method=method, max_len=min(max_len, model.context_length - 2),
                             sot=getattr(tokenizer, "sot_token_id", 49406),
                             eot=getattr(tokenizer, "eot_token_id", 49407), pad=pad)
    if hasattr(tokenizer, "decode"):
        return [tokenizer.decode(row).strip() for row in rows]
    import open_clip

    return [open_clip.decode(row).strip() for row in rows]


def _next_logits(clip, images, tokens, image_latent, image_embs) -> torch.Tensor:
    """The decoder's log-probabilities of the token after ``tokens [n, t]`` (fp32)."""
    out = clip(images, tokens, image_latent=image_latent, image_embs=image_embs, output_labels=False)
    return out["logits"][:, -1].float().log_softmax(-1)


@torch.no_grad()
def generate_captions(clip, images: torch.Tensor, *, method: str = "beam_search", max_len: int = 30,
                      sot: int = 49406, eot: int = 49407, pad: int = 0, beams: int = 4, top_k: int = 50,
                      top_p: float = 0.9, temperature: float = 1.0, generator: torch.Generator | None = None
                      ) -> list[list[int]]:
    """Each image's caption tokens (after the start token, up to and without the end token) from
    ``clip`` (an open_clip ``CoCa``) on normalised ``images [n, 3, s, s]``; at most ``max_len`` tokens."""
    if method not in METHODS:
        raise ValueError(f"generation {method!r}: use one of {', '.join(METHODS)}")
    image_latent, image_embs = clip._encode_image(images)
    if method == "beam_search":
        return [_beam_search(clip, images[i:i + 1], image_latent[i:i + 1], image_embs[i:i + 1], max_len, sot, eot,
                             beams) for i in range(images.shape[0])]
    rows = images.shape[0]
    tokens = torch.full((rows, 1), sot, dtype=torch.long, device=images.device)
    done = torch.zeros(rows, dtype=torch.bool, device=images.device)
    for _ in range(max_len):
        logp = _next_logits(clip, images, tokens, image_latent, image_embs) / temperature
        if method == "top_k":
            kth = logp.topk(min(top_k, logp.shape[-1]), dim=-1).values[:, -1:]
            logp = logp.masked_fill(logp < kth, float("-inf"))
        else:  # nucleus: the smallest set of tokens whose probability reaches top_p
            ordered, order = logp.softmax(-1).sort(dim=-1, descending=True)
            drop = ordered.cumsum(-1) - ordered > top_p
            logp = logp.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        choice = torch.multinomial(logp.softmax(-1), 1, generator=generator).squeeze(1)
        choice = torch.where(done, torch.full_like(choice, pad), choice)
        tokens = torch.cat([tokens, choice[:, None]], 1)
        done |= choice == eot
        if bool(done.all()):
            break
    return [_cut(row[1:].tolist(), eot, pad) for row in tokens]


def _cut(tokens: list[int], eot: int, pad: int) -> list[int]:
    out = []
    for token in tokens:
        if token in (eot, pad):
            break
        out.append(token)
    return out


def _beam_search(clip, image, image_latent, image_embs, max_len, sot, eot, beams) -> list[int]:
    """One image's best caption by beam search, scored by the log-probability per token."""
    device = image.device
    alive = torch.full((1, 1), sot, dtype=torch.long, device=device)
    scores = torch.zeros(1, device=device)
    finished: list[tuple[float, list[int]]] = []
    for _ in range(max_len):
        n = alive.shape[0]
        logp = _next_logits(clip, image.expand(n, -1, -1, -1), alive, image_latent.expand(n, -1),
                            image_embs.expand(n, -1, -1))
        total = (scores[:, None] + logp).flatten()
        best, index = total.topk(min(2 * beams, total.numel()))
        vocab = logp.shape[-1]
        keep_tokens, keep_scores = [], []
        for score, flat in zip(best.tolist(), index.tolist(), strict=True):
            beam, token = divmod(flat, vocab)
            sequence = alive[beam].tolist()[1:] + [token]
            if token == eot:
                finished.append((score / len(sequence), sequence[:-1]))
            elif len(keep_tokens) < beams:
                keep_tokens.append(alive[beam].tolist() + [token])
                keep_scores.append(score)
        if len(finished) >= beams or not keep_tokens:
            break
        alive = torch.tensor(keep_tokens, dtype=torch.long, device=device)
        scores = torch.tensor(keep_scores, device=device)
    if not finished:  # none ended within max_len: the best one alive
        finished = [(float(s) / (alive.shape[1] - 1), row[1:]) for s, row in zip(scores.tolist(), alive.tolist(),
                                                                                   strict=True)]
    return max(finished, key=lambda item: item[0])[1]
