"""The contrastive loss, the term every step has: the configured loss backend (``loss=``: ``losses/``) on the
gathered features, times ``loss.contrastive_weight``, and the step's logged loss made of it and the other
objectives' terms.

It is not an ``Objective``: the other objectives plug into it (their ``loss_inputs`` are its keyword inputs: a
teacher's features, hard negatives' features) or beside it (their terms add to its value). GradCache's phase 2 takes
its gradients with respect to the features; the one-pass step back-propagates it with the other terms."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Objective


class Contrastive:
    """``loss_fn`` (a ``ContrastiveLoss``, with a teacher's term where ``distill.teacher`` is set) times
    ``weight``. ``terms`` holds the last step's named values for the log where there are other terms."""

    def __init__(self, loss_fn, weight: float = 1.0):
        self.loss_fn, self.weight = loss_fn, float(weight)
        self.terms: dict[str, torch.Tensor] = {}

    def __call__(self, *features, **inputs) -> torch.Tensor:
        """The weighted loss of ``features`` (image, text, scale[, bias]) with the objectives' ``inputs``."""
        loss = self.loss_fn(*features, **inputs)
        return loss if self.weight == 1 else loss * self.weight

    def logged(self, contrastive: torch.Tensor, objectives: Sequence[Objective]) -> torch.Tensor:
        """The step's loss for the log: ``contrastive`` (this term's weighted value) plus each objective's weighted
        term; with such terms, ``terms`` gets the contrastive loss unweighted and each objective's own."""
        values = [value for objective in objectives if (value := objective.value()) is not None]
        if not values:
            return contrastive
        self.terms = {"contrastive": contrastive / self.weight if self.weight else contrastive}
        for objective in objectives:
            self.terms.update(objective.terms())
        for value in values:
            contrastive = contrastive + value
        return contrastive
