"""The training terms beside the contrastive loss, one file each, behind one seam (``base.Objective``): the
step and GradCache loop over them and name none. ``build`` makes a run's list from its config.

A new objective: a subclass of ``Objective`` in a file here, an entry in ``build`` (and its config key, checked in
``config/schema.py``'s ``validate``), and a row in ``tests/train/test_objectives_contract.py``'s ``OBJECTIVES``,
which proves one pass, GradCache, offload and 2 ranks give the same loss and gradients with it."""

from __future__ import annotations

from .base import Objective
from .caption import Caption
from .negatives import HardNegatives
from .teacher import TeacherFeatures

__all__ = ["Caption", "HardNegatives", "Objective", "TeacherFeatures", "build"]


def build(caption_weight: float = 0.0, pad_id: int | None = None, teacher=None, negatives: bool = False,
          device=None) -> list[Objective]:
    """The objectives of a run, in the order their hooks run: the teacher's features (the distilled loss's
    input), the hard negatives (the softmax's extra columns), the caption term."""
    objectives: list[Objective] = []
    if teacher is not None:
        objectives.append(TeacherFeatures(teacher))
    if negatives:
        objectives.append(HardNegatives())
    if caption_weight > 0:
        objectives.append(Caption(caption_weight, pad_id, device))
    return objectives
