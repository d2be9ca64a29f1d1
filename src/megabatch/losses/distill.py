"""Distillation from a teacher CLIP at any batch: OpenCLIP's ``DistillClipLoss`` term, computed in row
blocks so that no ``b x b`` matrix is held, on one process or across ranks.

The term (both directions, as OpenCLIP's): the cross-entropy of the student's softmax against the
teacher's,

    D = (1/2b) sum_i CE(p_i, q_i) + (1/2b) sum_j CE(p^T_j, q^T_j),   CE(p, q) = -sum_k p_k log q_k,

with ``q = softmax(scale * I T^T)`` the student's and ``p = softmax(teacher_scale * I' T'^T)`` the
teacher's (``I'``, ``T'``: the teacher's features of the same samples). Per row,
``CE = lse(s) - sum_k p_k s_k``, and ``dCE/ds = q - p``: a block of rows needs its student and teacher
logits only while it is processed, so memory is ``rows_per_block x b`` for the logits plus the gathered
``[b, c]`` features and their gradient accumulators, linear in b.

Across W ranks each rank gathers the student's and the teacher's features (no autograd) and computes
its own rows in both directions (its images against every text, its texts against every image); the
gradients of the gathered columns are summed by one all-reduce and each rank keeps its slice, as in
DisCo-CLIP (``disco.py``). The gradient contract is ``base.ContrastiveLoss``'s.

That is the torch path (``_Distill``). On CUDA (``loss.impl=auto|triton``, one teacher) the fused kernels
(``kernels/triton_tiles.py``: ``distill_stats``, the student's and the teacher's log-sum-exps, then
``distill_block``) take each rank's image rows against every text, both directions, and give the contrastive loss
from the same passes (``_DistilledFused``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.gather import gather_no_grad, group_rank, group_size
from .infcl import _row_dots
from .reference import upcast

# logits of one block: rows x columns elements at most (x 4 bytes, about five such tensors alive at once: 5 GB;
# 256 rows a block at 1M columns)
BLOCK_ELEMENTS = 1 << 28


def distill_loss_reference(image_features: torch.Tensor, text_features: torch.Tensor, scale: torch.Tensor,
                           teacher_image: torch.Tensor, teacher_text: torch.Tensor,
                           teacher_scale: torch.Tensor | float) -> torch.Tensor:
    """The distillation term over the whole ``[b, c]`` batch, dense: OpenCLIP's ``DistillClipLoss``
    ``(dist_loss(teacher I->T, student I->T) + dist_loss(teacher T->I, student T->I)) / 2``. An ensemble
    (``[b, members, c_teacher]`` teacher features, ``teacher_scale`` one per member): the target is the
    mean of the members' probabilities (MobileCLIP's)."""
    student = upcast(image_features @ text_features.T) * scale
    if teacher_image.dim() == 2:
        teacher_image, teacher_text = teacher_image[:, None], teacher_text[:, None]
    members = teacher_image.shape[1]
    scales = teacher_scale if isinstance(teacher_scale, (tuple, list)) else (teacher_scale,) * members
    logits = [upcast(teacher_image[:, m] @ teacher_text[:, m].T) * scales[m] for m in range(members)]
    rows = sum(t.softmax(1) for t in logits) / members
    columns = sum(t.T.softmax(1) for t in logits) / members

    def cross_entropy(target, logits):
        return -(target * logits.log_softmax(1)).sum(1).mean()

    return (cross_entropy(rows, student) + cross_entropy(columns, student.T)) / 2


def _block_rows(columns: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(columns, 1))


def _logits(rows: torch.Tensor, columns: torch.Tensor, scale, dots: torch.dtype | None) -> torch.Tensor:
    """``scale * rows @ columns^T`` in fp32 at least; ``dots``: the dtype the values are exact in (bf16
    buffers copied to fp32), in which the GEMM then runs."""
    if dots is not None:
        rows, columns = rows.to(dots), columns.to(dots)
    return upcast(rows @ columns.T) * scale


def _teacher_probs(rows: torch.Tensor, columns: torch.Tensor, teacher_scale, dots) -> torch.Tensor:
    """The teacher's softmax of a block of ``rows`` against all ``columns``; an ensemble's
    (``[n, members, c]``, one scale per member) the mean of its members'."""
    if rows.dim() == 2:
        return _logits(rows, columns, teacher_scale, dots).softmax(1)
    members = rows.shape[1]
    scales = teacher_scale if isinstance(teacher_scale, tuple) else (teacher_scale,) * members
    probs = None
    for member, member_scale in enumerate(scales):
        p = _logits(rows[:, member], columns[:, member], member_scale, dots).softmax(1)
        probs = p if probs is None else probs.add_(p)
    return probs.div_(members)


def _direction(rows, columns, teacher_rows, teacher_columns, scale, teacher_scale, dots,
               weight=None, d_rows=None, d_columns=None):
    """One direction over this rank's ``rows`` against all ``columns``, in blocks of rows. Without
    ``weight``: the sum of the rows' cross-entropies. With it (backward): ``weight x dCE/d`` into
    ``d_rows`` and ``d_columns`` (fp32 at least), and returns the scale's gradient."""
    total = torch.zeros((), dtype=torch.promote_types(rows.dtype, torch.float32), device=rows.device)
    step = _block_rows(columns.shape[0])
    for start in range(0, rows.shape[0], step):
        block = slice(start, start + step)
        student = _logits(rows[block], columns, scale, dots)
        teacher = _teacher_probs(teacher_rows[block], teacher_columns, teacher_scale, dots)
        if weight is None:
            total += (student.logsumexp(1) - (teacher * student).sum(1)).sum()
            continue
        grad = student.softmax(1).sub_(teacher).mul_(weight)  # d(weight x CE)/d logits
        total += (grad * student).sum() / scale
        grad = grad.mul_(scale).to(d_rows.dtype)
        d_rows[block] += grad @ columns.to(grad.dtype)
        d_columns += grad.T @ rows[block].to(grad.dtype)
    return total


def _merge_columns(column: torch.Tensor, group) -> torch.Tensor:
    """``[k, b]`` column log-sum-exps over this rank's rows (``triton_tiles.distill_stats``') -> over every rank's."""
    parts = gather_no_grad(column.contiguous(), group).view(group_size(group), *column.shape)
    return parts.logsumexp(0)


class _Distill(torch.autograd.Function):
    """The term alone in torch's row blocks (``_direction``): this rank's image rows against every text, and its
    text rows against every image."""

    @staticmethod
    def forward(ctx, image_features, text_features, scale, teacher_image, teacher_text, teacher_scale, group, dots):
        world, rows = group_size(group), image_features.shape[0]
        all_images, all_texts = gather_no_grad(image_features, group), gather_no_grad(text_features, group)
        all_teacher_images = gather_no_grad(teacher_image, group)
        all_teacher_texts = gather_no_grad(teacher_text, group)
        local = (_direction(image_features, all_texts, teacher_image, all_teacher_texts, scale, teacher_scale, dots)
                 + _direction(text_features, all_images, teacher_text, all_teacher_images, scale, teacher_scale, dots))
        local = local / (2 * rows)
        total = local.clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        ctx.save_for_backward(image_features, text_features, scale, teacher_image, teacher_text)
        ctx.teacher_scale, ctx.group, ctx.world, ctx.dots = teacher_scale, group, world, dots
        return total / world

    @staticmethod
    def backward(ctx, grad_output):
        image_features, text_features, scale, teacher_image, teacher_text = ctx.saved_tensors
        group, world, rows, dots = ctx.group, ctx.world, image_features.shape[0], ctx.dots
        rank = group_rank(group)
        all_images, all_texts = gather_no_grad(image_features, group), gather_no_grad(text_features, group)
        all_teacher_images = gather_no_grad(teacher_image, group)
        all_teacher_texts = gather_no_grad(teacher_text, group)
        acc = torch.promote_types(image_features.dtype, torch.float32)
        weight = grad_output.to(acc) / (2 * rows)  # W-scaled per-rank gradient (base.py contract)
        d_image = torch.zeros(image_features.shape, dtype=acc, device=image_features.device)
        d_text = torch.zeros_like(d_image)
        # every rank's column gradients w.r.t. the gathered features: texts [b] (image rows), images [b]
        d_columns = torch.zeros((2 * all_texts.shape[0], all_texts.shape[1]), dtype=acc, device=d_image.device)
        b = all_texts.shape[0]
        d_scale = _direction(image_features, all_texts, teacher_image, all_teacher_texts, scale, ctx.teacher_scale,
                             dots, weight, d_image, d_columns[:b])
        d_scale = d_scale + _direction(text_features, all_images, teacher_text, all_teacher_images, scale,
                                       ctx.teacher_scale, dots, weight, d_text, d_columns[b:])
        if world > 1:
            dist.all_reduce(d_columns, group=group)
        d_image += d_columns[b + rank * rows:b + (rank + 1) * rows]
        d_text += d_columns[rank * rows:(rank + 1) * rows]
        return (d_image.to(image_features.dtype), d_text.to(text_features.dtype),
                d_scale.to(scale.dtype).reshape(scale.shape), None, None, None, None, None)


class _DistilledFused(torch.autograd.Function):
    """The fused kernels, both terms at once: the student's and the teacher's log-sum-exps (``distill_stats``, one
    pass each over this rank's rows against every rank's columns, the column statistics merged over the ranks;
    the student's are both terms'), then one pass over both matrices' tiles (``distill_block``) that sums the
    teacher-weighted student logits, the term's other half, and writes ``G`` of ``weights[0]`` x the contrastive
    loss plus ``weights[1]`` x the term into one pair of GEMMs (the column gradients summed by one all-reduce). That
    pass runs here in the forward (``grads``), since the term's value needs it, and the backward scales its gradients
    by the incoming one. Returns ``(total, contrastive, distill)``: ``total = weights[0] * contrastive + weights[1] *
    distill``, the only one with a gradient, each the same on every rank; the backward follows
    ``base.ContrastiveLoss``'s contract."""

    @staticmethod
    def forward(ctx, image_features, text_features, scale, teacher_image, teacher_text, teacher_scale, dots, precision,
                group, weights, grads):
        from ..kernels import triton_tiles

        rank, world, rows = group_rank(group), group_size(group), image_features.shape[0]
        own = slice(rank * rows, (rank + 1) * rows)  # this rank's columns
        all_texts, all_teacher_texts = gather_no_grad(text_features, group), gather_no_grad(teacher_text, group)
        row, column = triton_tiles.distill_stats(image_features, all_texts, teacher_image, all_teacher_texts, scale,
                                                 teacher_scale, precision, dots)  # [student, teacher] x rows / columns
        if world > 1:  # each column's statistics over every rank's rows
            column = _merge_columns(column, group)
        # W-scaled per-rank gradients (base.py contract), for an incoming gradient of 1
        contrastive_weight, weight = (float(w) / (2 * rows) for w in weights)
        d_image = d_columns = None
        if grads:
            d_image = torch.zeros(image_features.shape, dtype=torch.float32, device=image_features.device)
            d_columns = torch.zeros(all_texts.shape, dtype=torch.float32, device=image_features.device)
        cross, d_scale = triton_tiles.distill_block(
            image_features, all_texts, teacher_image, all_teacher_texts, scale, teacher_scale, row, column,
            weight if grads else None, d_image, d_columns, precision, dots, contrastive_weight=contrastive_weight,
            diagonal_offset=rank * rows)
        positives = _row_dots(image_features, text_features, torch.float32).sum()  # sum_i S_ii / scale, fp32
        lse = row[0].sum() + column[0, own].sum()
        terms = torch.stack([lse - 2 * positives * scale.float(), lse - cross]) / (2 * rows)
        if world > 1:
            dist.all_reduce(terms, group=group)
            if grads:
                dist.all_reduce(d_columns, group=group)
        if grads:
            ctx.save_for_backward(d_image, d_columns[own].clone(), d_scale)
        ctx.dtypes = image_features.dtype, text_features.dtype, scale.dtype, scale.shape
        contrastive, distill = terms[0] / world, terms[1] / world
        total = weights[1] * distill if not weights[0] else weights[0] * contrastive + weights[1] * distill
        ctx.mark_non_differentiable(contrastive, distill)
        return total, contrastive, distill

    @staticmethod
    def backward(ctx, grad_total, _grad_contrastive, _grad_distill):
        d_image, d_text, d_scale = ctx.saved_tensors
        image_dtype, text_dtype, scale_dtype, scale_shape = ctx.dtypes
        weight = grad_total.float()
        return ((d_image * weight).to(image_dtype), (d_text * weight).to(text_dtype),
                (d_scale * weight).to(scale_dtype).reshape(scale_shape), None, None, None, None, None, None, None, None)


def _fused(impl: str, fp32_precision: str, image_features: torch.Tensor, teacher_image: torch.Tensor,
           teacher_scale) -> str | None:
    """The kernels' ``fp32_precision`` where the fused kernels take the term (``distill_term``'s ``impl``), else
    ``None`` (the torch blocks)."""
    applies = (teacher_image.dim() == 2 and not isinstance(teacher_scale, tuple)
               and image_features.dtype in (torch.bfloat16, torch.float16, torch.float32))
    return fp32_precision if applies and (impl == "triton" or (impl == "auto" and image_features.is_cuda)) else None


def _needs_grads(*inputs: torch.Tensor) -> bool:
    """Whether a backward may follow (the fused pass then writes the gradients as it sums the term)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in inputs)


def distill_term(image_features, text_features, scale, teacher_image, teacher_text, teacher_scale, group=None,
                 values_in: torch.dtype | None = None, impl: str = "torch",
                 fp32_precision: str = "tf32") -> torch.Tensor:
    """The distillation term ``D`` of the global batch (this rank's ``[b_local, c]`` student features,
    ``[b_local, c_teacher]`` teacher features, L2-normalised; an ensemble's ``[b_local, members, c_teacher]``),
    the same value on every rank; its backward follows ``base.ContrastiveLoss``'s contract.
    ``teacher_scale``: a number, or one per member (no gradient).
    ``values_in``: the features hold values of this dtype (GradCache's bf16 buffers): the forward's
    GEMMs run in it. ``impl``: ``torch`` (row blocks of logits, any dtype, ensembles), ``triton`` (the fused
    kernels: one pass over the tiles for both directions, no logits held; for one teacher and bf16/fp16/fp32 features,
    the torch blocks otherwise) or ``auto`` (Triton on CUDA where it applies); ``fp32_precision``: the kernels'
    fp32 dots."""
    dots = values_in if values_in in (torch.bfloat16, torch.float16) else None
    teacher_scale = tuple(float(s) for s in teacher_scale) if isinstance(teacher_scale, (tuple, list)) \
        else float(teacher_scale)
    fused = _fused(impl, fp32_precision, image_features, teacher_image, teacher_scale)
    if fused:  # the kernels' passes (the contrastive value beside it unused; its weight 0)
        return _DistilledFused.apply(image_features, text_features, scale, teacher_image, teacher_text, teacher_scale,
                                     dots, fused, group, (0.0, 1.0), _needs_grads(image_features, text_features,
                                                                                  scale))[0]
    return _Distill.apply(image_features, text_features, scale, teacher_image, teacher_text, teacher_scale, group, dots)


class DistilledLoss(nn.Module):
    """A contrastive loss plus ``weight`` x the distillation term (``distill.weight``): called as the
    contrastive loss is, with ``teacher=(image, text)``, the teacher's features of the same samples.
    ``teacher_scale``: the teacher's logit multiplier (``1 / distill.temperature``). ``teacher``: the
    frozen model phase 1 runs (``train/step/teacher.py``), held here for the step. ``terms``: the last
    call's two terms, detached (the log's ``loss/contrastive`` and ``loss/distill``). ``impl``: the term's
    (``distill_term``), by default the contrastive loss's ``impl`` (``loss.impl``)."""

    def __init__(self, contrastive: nn.Module, weight: float, teacher_scale: float, teacher=None,
                 impl: str | None = None):
        super().__init__()
        # the term's kernels: the contrastive loss's choice (loss.impl) unless told
        self.impl = impl or getattr(contrastive, "impl", "auto")
        if getattr(contrastive, "uses_bias", False):
            raise ValueError(f"{type(contrastive).__name__} is a sigmoid loss: distillation (distill.teacher) "
                             "takes a softmax loss (loss=infcl, local, disco or vanilla)")
        self.contrastive, self.weight, self.teacher_scale = contrastive, float(weight), teacher_scale
        self.teacher = teacher
        self.terms: dict[str, torch.Tensor] = {}

    uses_bias = False

    @property
    def takes_negatives(self) -> bool:
        return getattr(self.contrastive, "takes_negatives", True)

    @property
    def group(self):
        return self.contrastive.group

    def forward(self, image_features, text_features, scale, *, teacher, values_in=None, negatives=None):
        teacher_image, teacher_text = teacher
        options = {} if negatives is None else {"negatives": negatives}
        if self.weight == 0:
            contrastive = self.contrastive(image_features, text_features, scale, values_in=values_in, **options)
            self.terms = {"contrastive": contrastive.detach()}
            return contrastive
        precision = getattr(self.contrastive, "fp32_precision", "tf32")
        teacher_scale = tuple(float(s) for s in self.teacher_scale) if isinstance(self.teacher_scale, (tuple, list)) \
            else float(self.teacher_scale)
        if (negatives is None and image_features.shape == text_features.shape and image_features.dim() == 2
                and _fused(self.impl, precision, image_features, teacher_image, teacher_scale)):
            # both terms from the same kernels' passes (every softmax loss is the same global loss; the term
            # gathers every rank's texts anyway, so a ring would save nothing here)
            self.contrastive.check_rows(image_features)
            dots = values_in if values_in in (torch.bfloat16, torch.float16) else None
            total, contrastive, distill = _DistilledFused.apply(
                image_features, text_features, scale, teacher_image.to(image_features.dtype),
                teacher_text.to(image_features.dtype), teacher_scale, dots, precision, self.group, (1.0, self.weight),
                _needs_grads(image_features, text_features, scale))
            self.terms = {"contrastive": contrastive, "distill": distill}
            return total
        contrastive = self.contrastive(image_features, text_features, scale, values_in=values_in, **options)
        distill = distill_term(image_features, text_features, scale, teacher_image.to(image_features.dtype),
                               teacher_text.to(image_features.dtype), self.teacher_scale, self.group, values_in,
                               self.impl, getattr(self.contrastive, "fp32_precision", "tf32"))
        self.terms = {"contrastive": contrastive.detach(), "distill": distill.detach()}
        return contrastive + self.weight * distill
