"""``distill.teacher``: the teacher's features of this rank's samples (a frozen model run without a graph, or
the embeddings stored in the shards), the distilled loss's ``teacher`` input. Never replayed; its term is the
loss's own (``losses/distill.py``: fused with the contrastive loss in the same kernels).

Config checks (``validate``, before anything is built): ``check_distill`` (its numbers, a softmax loss,
``data.train.teacher_key`` exactly with ``distill.teacher=stored``); the teacher is checked against the student
(context length, tokenizer, width) as the run builds it (``train/step/teacher.py``)."""

from __future__ import annotations

from typing import Any

import torch

from .base import Objective


class TeacherFeatures(Objective):
    """``teacher``: a ``train.teacher.Teacher`` or ``StoredTeacher`` (``features(sub, images, autocast)``)."""

    name = "teacher"

    def __init__(self, teacher):
        self.teacher = teacher
        self.new_step()

    def new_step(self) -> None:
        self.image = self.text = None  # phase 1's buffers [b_rank, *teacher.shape], in the image order

    def loss_inputs_one_pass(self, sub, images, extra_features, autocast) -> dict[str, Any]:
        return {"teacher": self.teacher.features(sub, images, autocast)}

    def encoded(self, sub, images, rows, total_rows, precision) -> None:
        if self.image is None:  # preallocated once this rank's rows are known
            self.image = torch.empty((total_rows, *self.teacher.shape), dtype=precision.feature_dtype,
                                     device=precision.device)
            self.text = self.image.new_empty(self.image.shape)
        self.image[rows], self.text[rows] = self.teacher.features(sub, images, precision.autocast)

    def loss_inputs(self, encoded) -> dict[str, Any]:
        inputs = {"teacher": (self.image.float(), self.text.float())}
        self.new_step()  # the buffers are no longer needed: fp32 copies go to the loss
        return inputs
