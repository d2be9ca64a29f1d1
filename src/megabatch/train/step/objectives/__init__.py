"""The training terms, one file each: the contrastive loss every step has (``contrastive.py``: the loss backend
times ``loss.contrastive_weight``) and, behind one seam (``base.Objective``), the terms and loss inputs beside it:
the step and GradCache loop over them and name none. ``build`` makes a run's list from its config.

A new objective: a subclass of ``Objective`` in a file here, an entry in ``build`` (and its config key, checked in
``config/schema.py``'s ``validate``), and a row in ``tests/train/test_objectives_contract.py``'s ``OBJECTIVES``,
which proves one pass, GradCache, offload and 2 ranks give the same loss and gradients with it."""

from __future__ import annotations

from .base import Objective
from .caption import Caption
from .contrastive import Contrastive
from .negatives import HardNegatives
from .self_distill import SelfDistillation
from .teacher import TeacherFeatures

__all__ = ["Caption", "Contrastive", "HardNegatives", "Objective", "SelfDistillation", "States", "TeacherFeatures",
           "build"]


def build(caption_weight: float = 0.0, pad_id: int | None = None, teacher=None, negatives: bool = False,
          device=None, decoder=None, self_distill: dict | None = None, caption_warmup_steps: int = 0
          ) -> list[Objective]:
    """The objectives of a run, in the order their hooks run: the teacher's features (the distilled loss's
    input), the hard negatives (the softmax's extra columns), the caption term (``decoder``: ``model.decoder``'s
    captioner, whose parallel-prediction draw takes the step; its weight reached after ``caption_warmup_steps``), the
    late self-distillation terms (``self_distill``: ``SelfDistillation``'s keywords)."""
    objectives: list[Objective] = []
    if teacher is not None:
        objectives.append(TeacherFeatures(teacher))
    if negatives:
        objectives.append(HardNegatives())
    if caption_weight > 0:
        objectives.append(Caption(caption_weight, pad_id, device, decoder, caption_warmup_steps))
    if self_distill is not None:
        objectives.append(SelfDistillation(**self_distill))
    return objectives


class States:
    """The objectives' own states as one checkpointed part (the ``Checkpointer``'s ``objectives``): each objective
    whose ``state_dict`` is not empty, under its ``name``. ``any``: whether there is one (the run registers the part
    only then, so a run of stateless objectives writes its checkpoints as before)."""

    def __init__(self, objectives: list[Objective]):
        self.objectives = list(objectives)
        names = [objective.name for objective in self.objectives]
        if len(set(names)) != len(names):
            raise ValueError(f"objectives with the same name keep their states under one key: {names}")

    @property
    def any(self) -> bool:
        return any(objective.state_dict() for objective in self.objectives)

    def state_dict(self) -> dict:
        return {objective.name: state for objective in self.objectives if (state := objective.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        for objective in self.objectives:
            if objective.name in state:
                objective.load_state_dict(state[objective.name])
