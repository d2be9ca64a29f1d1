"""``model.decoder``: a caption decoder over the image tower's tokens alone (LocCa's captioner, SigLIP 2's decoder
objective), for any CLIP; ``loss.caption_weight`` trains it, as it trains a CoCa's.

A small transformer decoder: each layer an open_clip self-attention block over the caption's tokens and a
cross-attention block reading the image tower's tokens (its last layer's, after ``ln_post``; projected to the
decoder's width). It has its own token embedding: it reads no output of the text tower. Trained with teacher forcing
(token t + 1 from the image and the caption up to t) and, for a share ``parallel`` of the captions, with parallel
prediction (LocCa): every input token is a learned mask token and the self-attention is not causal, so each token
is predicted from the image alone. Which captions are predicted in parallel is a hash of the caption's tokens and
the step (``step``, set by the caption objective): the same whatever the sub-batch or rank a caption is in, so one
pass, GradCache and several ranks give the same loss.

The decoder is a module of the ``ClipModel`` beside open_clip's model (not in its ``state_dict`` under ``clip.``):
checkpoints keep it (``decoder.*``) and the model's description rebuilds it; ``scripts/export.py``'s open_clip
folder holds the CLIP alone, or with ``decoder=true`` the decoder beside it (``models/export.py``), which an open_clip
folder given as ``model.pretrained`` brings back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from open_clip.transformer import LayerNorm, ResidualAttentionBlock
from torch import nn

from ..config import ConfigError


@dataclass(frozen=True)
class DecoderCfg:
    """``model.decoder.*``: ``layers`` (0: no decoder), ``width``, ``heads``, ``mlp_ratio``, and ``parallel``, the
    share of captions predicted in parallel (LocCa and SigLIP 2: 0.5)."""

    layers: int = 0
    width: int = 512
    heads: int = 8
    mlp_ratio: float = 4.0
    parallel: float = 0.5

    @classmethod
    def of(cls, values) -> DecoderCfg | None:
        """The decoder of ``model.decoder`` (a mapping or ``None``), or ``None`` where it has no layers; a bad value
        is a ``ConfigError`` naming the key."""
        if not values:
            return None
        known = {name for name in cls.__dataclass_fields__}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"model.decoder.{unknown[0]}: no such key (model.decoder takes "
                              f"{', '.join(sorted(known))})")
        cfg = cls(**{key: value for key, value in dict(values).items()})
        if cfg.layers < 0 or (cfg.layers and (cfg.width <= 0 or cfg.heads <= 0 or cfg.width % cfg.heads)):
            raise ConfigError(f"model.decoder: layers={cfg.layers}, width={cfg.width}, heads={cfg.heads}: give "
                              "layers >= 0 and a width divisible by heads (model.decoder.layers=0: no decoder)")
        if not 0.0 <= cfg.parallel <= 1.0:
            raise ConfigError(f"model.decoder.parallel={cfg.parallel}: give the share of captions predicted in "
                              "parallel, between 0 and 1 (LocCa's and SigLIP 2's: 0.5)")
        return cfg if cfg.layers > 0 else None

    def to_dict(self) -> dict:
        return asdict(self)


class CaptionDecoder(nn.Module):
    """A caption decoder over image tokens ``[n, t, image_width]`` (see the module); ``vocab_size`` and
    ``context_length`` are the text tower's, ``pad_id`` its padding token (not predicted)."""

    def __init__(self, cfg: DecoderCfg, image_width: int, vocab_size: int, context_length: int, pad_id: int = 0):
        super().__init__()
        self.cfg, self.pad_id, self.context_length = cfg, pad_id, context_length
        width = cfg.width
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.randn(context_length, width) * 0.01)
        self.mask_embedding = nn.Parameter(torch.randn(width) * 0.02)  # parallel prediction's input token
        self.image_proj = nn.Linear(image_width, width)
        self.self_blocks = nn.ModuleList(ResidualAttentionBlock(width, cfg.heads, cfg.mlp_ratio)
                                         for _ in range(cfg.layers))
        self.cross_blocks = nn.ModuleList(ResidualAttentionBlock(width, cfg.heads, cfg.mlp_ratio,
                                                                 is_cross_attention=True)
                                          for _ in range(cfg.layers))
        self.ln_final = LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=width ** -0.5)
        nn.init.zeros_(self.head.bias)
        # the step, for the parallel draw: a tensor, so that a compiled decoder reads it without recompiling
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=False)

    def parallel_rows(self, texts: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: the captions predicted in parallel this step (a hash of each caption's tokens and the step,
        below the share ``parallel``)."""
        if self.cfg.parallel <= 0:
            return torch.zeros(texts.shape[0], dtype=torch.bool, device=texts.device)
        weights = torch.arange(1, texts.shape[1] + 1, device=texts.device)
        mixed = ((texts.long() * weights).sum(1) + self.step * 7919) % 65521
        return (mixed * 40503) % 65536 < int(round(self.cfg.parallel * 65536))

    def states(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
               parallel: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, L, width]``: the last layer's states after each of ``tokens [n, L]``, normalised (``ln_final``), which
        the head reads: teacher forcing, or for rows ``parallel`` each position from the image alone (mask tokens in,
        no causal mask)."""
        rows, length = tokens.shape
        x = self.token_embedding(tokens)
        if parallel is not None:
            x = torch.where(parallel[:, None, None], self.mask_embedding.to(x.dtype), x)
        x = x + self.positional_embedding[:length].to(x.dtype)
        causal = torch.full((length, length), float("-inf"), device=x.device).triu(1)
        mask = causal.expand(rows, length, length)
        if parallel is not None:
            mask = torch.where(parallel[:, None, None], torch.zeros_like(causal), causal)
        heads = self.cfg.heads
        mask = mask.repeat_interleave(heads, dim=0)  # [n x heads, L, L]: nn.MultiheadAttention's per-sample masks
        memory = self.image_proj(image_tokens)
        for attend, read in zip(self.self_blocks, self.cross_blocks, strict=True):
            x = attend(x, attn_mask=mask)
            x = read(x, k_x=memory, v_x=memory)
        return self.ln_final(x)

    def logits(self, image_tokens: torch.Tensor, tokens: torch.Tensor,
               parallel: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, L, vocab]``: the next token's logits after each of ``tokens [n, L]`` (``states``' rows and
        ``parallel``)."""
        return self.head(self.states(image_tokens, tokens, parallel))

    def caption_states(self, image_tokens: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """``states`` of the captions ``texts`` as the caption objective trains them: of each caption's tokens but the
        last, teacher forcing, or parallel prediction for the rows ``parallel_rows`` draws this step."""
        return self.states(image_tokens, texts[:, :-1], self.parallel_rows(texts))

    def loss(self, image_tokens: torch.Tensor, texts: torch.Tensor, predicted: int | None = None) -> torch.Tensor:
        """The cross-entropy summed over the captions' tokens after the first (padding left out), from
        ``caption_states`` (``head_loss``: ``predicted``)."""
        return self.head_loss(self.caption_states(image_tokens, texts), texts, predicted)

    def head_loss(self, states: torch.Tensor, texts: torch.Tensor, predicted: int | None = None) -> torch.Tensor:
        """The cross-entropy summed over ``texts``' tokens after the first, padding left out, from ``states`` (of
        ``texts[:, :-1]``). The head and the softmax over the vocabulary run at those tokens alone, not at every
        place of the context: a caption shorter than the context costs its own length. ``predicted``: their count,
        counted on the host where the token ids are (the caption objective's), so that nothing waits for the GPU;
        ``None``: counted here (one wait)."""
        targets = texts[:, 1:].flatten()
        padding = (targets == self.pad_id).to(torch.int32)
        if predicted is None:
            predicted = int(targets.numel() - padding.sum())
        places = torch.argsort(padding, stable=True)[:predicted]  # the predicted tokens', in order
        chunk = max(1, HEAD_BYTES // (4 * self.head.out_features))
        return _HeadCrossEntropy.apply(states.flatten(0, 1)[places], targets[places], self.head, chunk,
                                       torch.is_grad_enabled(), self.head.weight, self.head.bias)


HEAD_BYTES = 256 * 2**20  # the head's logits of one chunk of tokens, fp32 (~1,350 tokens of open_clip's 49,408)


class _HeadCrossEntropy(torch.autograd.Function):
    """``sum CE(head(states), targets)`` over ``[k, width]`` states, ``chunk`` rows at a time: the logits of one
    chunk live at once (fp32 at least, as ``cross_entropy`` takes them), never ``[k, vocab]``. Where a gradient is
    asked for, the forward makes it chunk by chunk (the softmax less the targets, times the head's weight for the
    states, times the states for the weight, in the logits' own dtype as the head's backward would; summed over the
    chunks in fp32 at least) and the backward scales it by the loss's incoming gradient; ``grads``: whether autograd
    is on where the loss is made (inside the forward it is off, and ``needs_input_grad`` does not say). ``weight``
    and ``bias`` (``head``'s) are passed so that autograd sees them; the logits come from calling ``head``, under the
    caller's autocast."""

    @staticmethod
    def forward(ctx, states, targets, head, chunk, grads, weight, bias):
        wanted = [grads and needed for needed in ctx.needs_input_grad]
        total = states.new_zeros((), dtype=torch.promote_types(states.dtype, torch.float32))
        d_states = torch.empty_like(states) if wanted[0] else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        d_weight = d_bias = None  # the first chunk's, then the sums
        grad_weight, grad_bias = wanted[5], bias is not None and wanted[6]
        for start in range(0, states.shape[0], chunk):
            # detached: a view made here would claim autograd's attention without a graph (FLOP counters' hooks)
            rows, goal = states[start:start + chunk].detach(), targets[start:start + chunk]
            logits = head(rows)
            dtype = logits.dtype  # the autocast dtype, or the states' own
            logits = logits.to(total.dtype)
            lse = logits.logsumexp(1)
            total += (lse - logits.gather(1, goal[:, None])[:, 0]).sum()
            if d_states is None and not grad_weight and not grad_bias:
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(grad.shape[0], device=grad.device), goal] -= 1
            if grad_bias:
                part = grad.sum(0).to(acc)
                d_bias = part if d_bias is None else d_bias.add_(part)
            grad = grad.to(dtype)
            with torch.autocast(states.device.type, enabled=False):
                if d_states is not None:
                    d_states[start:start + chunk] = grad @ weight.to(dtype)
                if grad_weight:
                    part = (grad.T @ rows.to(dtype)).to(acc)
                    d_weight = part if d_weight is None else d_weight.add_(part)
        if grad_weight and d_weight is None:
            d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        if grad_bias and d_bias is None:
            d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device)
        made = (d_states, d_weight, d_bias)
        ctx.save_for_backward(*(t if t is not None else states.new_empty(0) for t in made))
        ctx.made = tuple(t is not None for t in made)
        ctx.dtypes = (states.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        d_states, d_weight, d_bias = ((grad * grad_output.to(grad.dtype)).to(dtype) if made else None
                                      for grad, made, dtype in zip(ctx.saved_tensors, ctx.made, ctx.dtypes,
                                                                   strict=True))
        return d_states, None, None, None, None, d_weight, d_bias


class DecoderCaptioner:
    """A ``ClipModel`` with a ``CaptionDecoder`` seen as ``models/generate.py`` sees an open_clip ``CoCa``:
    ``_encode_image(images)`` -> ``(latent, image tokens)`` and a call giving ``{"logits": ...}`` of the tokens so
    far (teacher forcing)."""

    def __init__(self, model):
        self.model = model

    def _encode_image(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.image_and_tokens(images)

    def __call__(self, images, tokens, image_latent=None, image_embs=None, output_labels=False) -> dict:
        return {"logits": self.model.decoder.logits(image_embs, tokens)}
