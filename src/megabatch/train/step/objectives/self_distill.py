"""``self_distill.weight`` and ``self_distill.masked_weight``: SigLIP 2's late terms, on an EMA teacher of the image
tower (SILC's local-to-global self-distillation; TIPS's masked prediction), from the share ``self_distill.start`` of
training on.

The student's side is the model's (``models/views.py``: its crops of each image and its masked view, through the
image tower, and the heads over them: the forward's ``views`` output). This objective owns the rest: the teacher (a
whole copy of the image tower and the heads, on every rank, copied from the student at the start step and moved
toward it by ``teacher_momentum`` at each step after), its targets (the teacher's logits of the whole image, centered
and sharpened: ``softmax((t - center) / teacher_temp)``), the cross-entropies against the student's
``softmax(s / student_temp)``, and the two centers (the teacher's mean logits over the global batch, every rank's,
moved by ``center_momentum`` once a step). The local-to-global term averages over every crop of the global batch,
the masked term over every masked token.

At any batch: each sub-batch's terms are computed in GradCache's replay (the teacher's forward without a graph, the
views drawn from the images and the step, not the RNG), so nothing grows with the global batch; every sub-batch is
encoded again (no phase-1 graph is kept: it has no views). Before the start step the model is asked for no views and
the terms are absent (the heads' gradients are zero: ``ViewHeads.untouched``).

Config checks (``validate``, before anything is built): ``check_self_distill`` (its numbers; a trained image tower
that encodes its images); the tower is checked as the model gets its heads (``models.views.check_views``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ....distributed.fsdp import full
from ....models.images import normalize_images
from ....models.views import PARAMETERS as VIEW_PARAMETERS
from .base import Objective


class SelfDistillation(Objective):
    """The late terms of a ``ClipModel`` with ``views`` (``attach_views``); ``settings``: ``self_distill.*``
    (``config.run.SelfDistillSettings``); ``start_step``: the first step (counted from 0) with the terms;
    ``precision``: the step's (the teacher's autocast, the fp16 loss scale)."""

    name = "self_distill"
    keeps_graphs = False  # a sub-batch's views come with its replay

    def __init__(self, model, settings, start_step: int, precision):
        from ....models.openclip import from_description

        self.settings, self.start_step, self.precision = settings, int(start_step), precision
        self.heads, self.student = model.views, model.clip.visual
        self.mean, self.std = model.preprocess["mean"], model.preprocess["std"]
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.world = dist.get_world_size() if self.distributed else 1
        device = precision.device
        # the teacher: a whole copy of the image tower and the heads (rebuilt from the model's description, so it is
        # whole on every rank where the student is sharded), its weights the student's from the start step on
        copy = from_description(model.description())
        self.teacher = torch.nn.ModuleDict({"visual": copy.clip.visual, "heads": copy.views})
        self.teacher.to(device).eval().requires_grad_(False)
        del copy
        students = dict(self.student.named_parameters(prefix="visual"))
        students.update(self.heads.named_parameters(prefix="heads"))
        self.pairs = [(teacher, students[name]) for name, teacher in self.teacher.named_parameters()]
        prototypes = self.heads.cfg.prototypes
        self.center = torch.zeros(prototypes, device=device)
        self.patch_center = torch.zeros(prototypes, device=device)
        self.steps, self.started, self.active = 0, False, False
        self._reset()

    @property
    def model_options(self) -> dict:
        return {"views": True} if self.active else {}

    def _reset(self) -> None:
        self.local, self.rows, self._value = 0, None, None
        self.sums: dict[str, list] = {"crops": [], "masked": [], "center": [], "patch_center": []}

    @torch.no_grad()
    def _move_teacher(self) -> None:
        """The teacher toward the student (a copy at the start step): ``t <- m t + (1 - m) s``."""
        teachers = [teacher for teacher, _ in self.pairs]
        students = [full(student).detach().to(teacher.dtype) for teacher, student in self.pairs]  # all-gathered
        if not self.started:
            torch._foreach_copy_(teachers, students)
            self.started = True
        else:
            torch._foreach_lerp_(teachers, students, 1.0 - self.settings.teacher_momentum)

    owns = VIEW_PARAMETERS  # the student's heads: their weight decay held at 0 until the start step (TrainStep.apply)

    @property
    def trains_now(self) -> bool:
        return self.active

    def new_step(self) -> None:
        self._reset()
        self.active = self.steps >= self.start_step
        self.steps += 1
        if self.active:
            self.heads.step.fill_(self.steps)
            self._move_teacher()

    def one_pass_start(self, sub) -> None:
        self.rows = len(sub.texts) * self.world

    def one_pass_term(self, outputs: tuple, images: torch.Tensor) -> torch.Tensor | None:
        return self._term(outputs, images, 1.0) if self.active else None

    def encoded(self, sub, images, rows, total_rows, precision) -> None:
        self.local += len(sub.texts)

    def before_replay(self, precision) -> None:
        self.rows = self.local * self.world

    def replay_term(self, outputs: tuple, images: torch.Tensor | None) -> torch.Tensor | None:
        if not self.active:
            return None
        return self._term(outputs, images, self.precision.scaler.scale(1.0))

    def _term(self, outputs: tuple, images: torch.Tensor, scale: float) -> torch.Tensor:
        """This sub-batch's share of the global terms (weighted; DDP averages the gradients: ``world`` times)."""
        student, settings = outputs[4]["views"], self.settings
        with torch.no_grad(), self.precision.autocast():
            normalized = normalize_images(images, self.mean, self.std)
            teacher = self.teacher["heads"].teacher(self.teacher["visual"], normalized, student.get("positions"))
        total = None
        for key, center, weight, per_row in (("crops", self.center, settings.weight, settings.local_crops),
                                             ("masked", self.patch_center, settings.masked_weight,
                                              self.heads.masked_count)):
            if key not in student:
                continue
            target = teacher[key].float()
            self.sums["center" if key == "crops" else "patch_center"].append(target.reshape(-1, target.shape[-1])
                                                                              .sum(0))
            probs = torch.softmax((target - center) / settings.teacher_temp, dim=-1)
            if key == "crops":  # the whole image's target for each of its crops
                probs = probs[:, None]
            logp = torch.log_softmax(student[key].float() / settings.student_temp, dim=-1)
            entropy = -(probs * logp).sum()
            self.sums[key].append(entropy.detach())
            term = entropy * (weight * self.world * scale / (self.rows * per_row))
            total = term if total is None else total + term
        return total

    def value(self) -> torch.Tensor | None:
        """The weighted terms of the global batch (every rank's sums and teacher logits: one all-reduce, once a
        step); the centers move to this step's mean teacher logits here."""
        if not self.active:
            return None
        if self._value is None:
            settings, device = self.settings, self.center.device
            prototypes = len(self.center)
            parts = [torch.stack(self.sums[key]).sum(0, keepdim=True) if self.sums[key]
                     else torch.zeros(1, device=device) for key in ("crops", "masked")]
            parts += [torch.stack(self.sums[key]).sum(0) if self.sums[key] else torch.zeros(prototypes, device=device)
                      for key in ("center", "patch_center")]
            flat = torch.cat(parts)
            if self.distributed:
                dist.all_reduce(flat)
            crops, masked = flat[0] / (self.rows * settings.local_crops), \
                flat[1] / (self.rows * max(1, self.heads.masked_count))
            momentum = settings.center_momentum
            if settings.weight > 0:
                self.center.mul_(momentum).add_(flat[2:2 + prototypes] / self.rows, alpha=1 - momentum)
            if settings.masked_weight > 0:
                self.patch_center.mul_(momentum).add_(flat[2 + prototypes:] / (self.rows * self.heads.masked_count),
                                                      alpha=1 - momentum)
            self._value = {"self_distill": crops, "masked": masked}
        return settings_total(self.settings, self._value)

    def terms(self) -> dict[str, torch.Tensor]:
        if self._value is None:
            return {}
        return {key: value for key, value in self._value.items()
                if (self.settings.weight if key == "self_distill" else self.settings.masked_weight) > 0}

    def state_dict(self) -> dict:
        state = {"steps": self.steps, "started": self.started, "center": self.center, "patch_center": self.patch_center}
        if self.started:
            state["teacher"] = self.teacher.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.started = int(state["steps"]), bool(state["started"])
        self.center.copy_(state["center"])
        self.patch_center.copy_(state["patch_center"])
        if "teacher" in state:
            self.teacher.load_state_dict(state["teacher"])


def settings_total(settings, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """``weight x`` the local-to-global term ``+ masked_weight x`` the masked term."""
    return settings.weight * values["self_distill"] + settings.masked_weight * values["masked"]


def start_step(start: float, total_steps: int) -> int:
    """The first step (from 0) of the late terms: ``start`` of ``total_steps`` done."""
    return int(math.floor(start * total_steps + 1e-9))
