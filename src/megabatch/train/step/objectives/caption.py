"""``loss.caption_weight``: a CoCa's caption loss, the decoder's cross-entropy summed over the global batch's
caption tokens (each caption's second token on, pad left out) and divided by their count, times the weight. The
decoder reads both towers' outputs, so with GradCache every sub-batch is encoded again, both towers, and adds its
own cross-entropy sum to its surrogate. The decoder is a CoCa's, or ``model.decoder``'s (``models/decoder.py``, any
CLIP: it reads the image tower's tokens alone), whose parallel-prediction draw takes the step counted here.

``loss.caption_warmup``: the weight rises linearly from 0 (the first step) to ``loss.caption_weight`` over that share
of the run's steps (``warmup_steps``), then stays. While the contrastive loss sits at chance its gradient is small,
and a caption term at full weight from the first step kept the digits' runs on that plateau longer (models.md).

Config checks (``validate``, before anything is built): ``check_loss`` (a weight >= 0) and ``check_negatives`` (not
with hard negatives); a model without a decoder is refused as the run builds it (``train_decoder``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Objective


class Caption(Objective):
    """The caption term of weight ``weight``, reached after ``warmup_steps`` steps (step ``s`` before: ``weight x s /
    warmup_steps``); ``pad_id``: the captions' pad token; ``device``: where the counts are summed (over every rank of
    the default process group where one is running)."""

    name = "caption"
    replays_both_towers = True
    keeps_graphs = False
    cuts_captions = False
    model_options = {"caption": True}  # the model's extra output "caption": the decoder's cross-entropy sum

    def __init__(self, weight: float, pad_id: int, device: torch.device, decoder=None, warmup_steps: int = 0):
        self.full_weight, self.pad_id, self.device = float(weight), pad_id, device
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.world = dist.get_world_size() if self.distributed else 1
        # model.decoder's captioner (its parallel-prediction draw) and the warm-up take the step (counted here,
        # checkpointed where either needs it)
        self.decoder, self.warmup_steps, self.steps = decoder, int(warmup_steps), 0
        self.weight = self.weight_at(0)
        self._reset()

    def weight_at(self, step: int) -> float:
        """The term's weight at ``step`` (from 0): ``loss.caption_weight``, less during the warm-up."""
        if step >= self.warmup_steps:
            return self.full_weight
        return self.full_weight * step / self.warmup_steps

    def _tokens(self, texts: torch.Tensor) -> int:
        """The tokens of ``texts`` the decoder predicts (counted on the host, where the token ids are: no sync)."""
        return int((texts[:, 1:] != self.pad_id).sum())

    def _global_tokens(self, local: int) -> torch.Tensor:
        """The global batch's caption tokens (every rank's ``local`` count summed: one small all-reduce). Filled on the
        device (``torch.tensor(n, device=...)`` would copy from pageable memory, which waits for the GPU)."""
        tokens = torch.full((), float(local), device=self.device)
        if self.distributed:
            dist.all_reduce(tokens)
        return tokens.clamp_(min=1.0)

    def _reset(self) -> None:
        self.local, self.sums, self.tokens, self.factor, self._value = 0, [], None, None, None
        self.counts: list[int] = []  # each sub-batch's predicted tokens, in order

    def model_options_for(self, index: int) -> dict:
        """``model.decoder``'s also the sub-batch's count of predicted tokens: its head runs at those alone, without
        counting them on the GPU (``CaptionDecoder.head_loss``)."""
        if self.decoder is None:
            return self.model_options
        return {**self.model_options, "caption_tokens": self.counts[index]}

    def new_step(self) -> None:
        self._reset()
        self.weight = self.weight_at(self.steps)
        if self.decoder is not None:
            self.decoder.step.fill_(self.steps)
        self.steps += 1

    def one_pass_start(self, sub) -> None:
        self._reset()
        self.counts.append(self._tokens(sub.texts))
        self.tokens = self._global_tokens(self.counts[0])

    def one_pass_term(self, outputs: tuple, images) -> torch.Tensor:
        caption = outputs[4]["caption"]
        self.sums.append(caption.detach())
        # DDP averages the gradients: the term is W-scaled as the contrastive loss is
        return caption * (self.weight * self.world / self.tokens)

    def encoded(self, sub, images, rows, total_rows, precision) -> None:
        self.counts.append(self._tokens(sub.texts))
        self.local += self.counts[-1]

    def before_replay(self, precision) -> None:
        self.tokens = self._global_tokens(self.local)
        self.factor = precision.scaler.scale(self.weight * self.world / self.tokens)

    def replay_term(self, outputs: tuple, images) -> torch.Tensor:
        caption = outputs[4]["caption"]
        self.sums.append(caption.detach())
        return caption * self.factor

    def value(self) -> torch.Tensor:
        """``weight x`` the caption loss of the global batch (every rank's sums: one all-reduce, once a step)."""
        if self._value is None:
            total = torch.stack(self.sums).sum() if self.sums else torch.zeros((), device=self.device)
            if self.distributed:
                dist.all_reduce(total)
            self._value = total / self.tokens
        return self.weight * self._value

    def terms(self) -> dict[str, torch.Tensor]:
        return {} if self._value is None else {"caption": self._value}

    def state_dict(self) -> dict:
        return {"steps": self.steps} if self.decoder is not None or self.warmup_steps > 0 else {}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", self.steps))
