"""The seam every training term beside the contrastive loss plugs into.

The step (``train/step/step.py``) and GradCache (``train/step/gradcache.py``) call these hooks on each objective in
turn and name none of them. An objective keeps its own per-step state (what phase 1 encoded of it, its gradients, its
logged value) and says what the replay must encode again. Its config checks live in ``config/schema.py``'s
``validate`` (before anything is built); the objectives a run trains with are built by ``objectives.build``.

The hooks, in the order a step calls them:

- one pass (one sub-batch, its graph kept): ``extra_texts`` (token rows the text tower encodes after the
  captions), ``one_pass_start``, then the towers, ``loss_inputs_one_pass`` (the contrastive loss's extra keyword
  inputs), the contrastive loss, ``one_pass_term`` (added to the loss before the one backward);
- GradCache: ``new_step``; phase 1 ``encoded`` per sub-batch and ``encoded_all`` once; phase 2 ``loss_inputs``
  (the extra inputs; a tensor that requires grad gets its gradient back through ``take_grads``) and
  ``before_replay``; phase 3 ``replay_first`` (before the sub-batch whose backward synchronises the ranks) and
  ``replay_term`` per re-encoded sub-batch (added to its surrogate);
- both: ``value`` (the term added to the logged loss, ``None`` for an input-only objective) and ``terms``;
- the checkpoint: ``state_dict`` and ``load_state_dict`` (``States``: the checkpointed part ``objectives``).
"""

from __future__ import annotations

from typing import Any

import torch


class Objective:
    """A training term, or an input of the contrastive loss, with its own state. The defaults do nothing."""

    name = "objective"
    replays_both_towers = False  # the replay must encode both towers again (a decoder reading their outputs)
    keeps_graphs = True          # phase 1 may keep sub-batches' graphs (False: every sub-batch is replayed)
    cuts_captions = True         # the captions may be cut to their length (False: the objective reads them whole)
    model_options: dict[str, Any] = {}  # extra keywords of the model's forward (its fifth output: a dict)
    owns: str | None = None  # the prefix of the parameters it alone trains (optim.OWNED): not decayed until trains_now
    trains_now = True        # whether this step trains them (self_distill: from its start step)

    def model_options_for(self, index: int) -> dict[str, Any]:
        """The model's forward keywords for this rank's sub-batch ``index`` (the one pass's: 0): ``model_options``,
        and what that sub-batch's own inputs say, read on the host (``one_pass_start``, ``encoded``)."""
        return self.model_options

    # the one-pass step
    def extra_texts(self, sub) -> torch.Tensor | None:
        """Token rows ``[n, ctx]`` the text tower encodes with this sub-batch's captions, after them."""
        return None

    def one_pass_start(self, sub) -> None:
        """Before the towers run on ``sub``."""

    def loss_inputs_one_pass(self, sub, images: torch.Tensor, extra_features: torch.Tensor | None,
                             autocast) -> dict[str, Any]:
        """The contrastive loss's keyword inputs from this objective; ``extra_features``: the text tower's
        features of ``extra_texts``."""
        return {}

    def one_pass_term(self, outputs: tuple, images: torch.Tensor) -> torch.Tensor | None:
        """The term added to the loss before the one backward (loss-scaled by the caller), from the model's
        ``outputs`` (the objectives' own in the fifth, a dict) of ``images``."""
        return None

    # GradCache
    def new_step(self) -> None:
        """A step begins: the last step's state is dropped."""

    def encoded(self, sub, images: torch.Tensor, rows: slice, total_rows: int, precision) -> None:
        """Phase 1 encoded ``sub`` (rows ``rows`` of this rank's ``total_rows``) without a graph."""

    def encoded_all(self, model, encoded, precision) -> None:
        """Phase 1 encoded every sub-batch of this rank."""

    def loss_inputs(self, encoded) -> dict[str, Any]:
        """Phase 2: the contrastive loss's keyword inputs (a tensor that requires grad gets its gradient back)."""
        return {}

    def take_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Phase 2: the gradients of the inputs ``loss_inputs`` gave that require grad, by keyword."""

    def before_replay(self, precision) -> None:
        """Phase 2 is done; the replay starts."""

    def replay_first(self, model, encoded, precision, sync) -> None:
        """Phase 3, before the replayed sub-batches."""

    def replay_term(self, outputs: tuple, images: torch.Tensor | None) -> torch.Tensor | None:
        """Phase 3: the term a re-encoded sub-batch adds to its surrogate, from the model's ``outputs`` of
        ``images`` (``None`` where the image tower is not replayed)."""
        return None

    # both
    def value(self) -> torch.Tensor | None:
        """This step's term added to the logged loss (weighted), or ``None``."""
        return None

    def terms(self) -> dict[str, torch.Tensor]:
        """This step's named values for the log (unweighted, 0-d on the device)."""
        return {}

    # the checkpoint
    def state_dict(self) -> dict[str, Any]:
        """What this objective carries from one step to the next (an EMA teacher's weights, a running center),
        saved in every checkpoint under its ``name`` and given back on resume; ``{}``: nothing to carry."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` gave (a resumed run)."""
