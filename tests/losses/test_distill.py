"""Distillation (``DistilledLoss``: a contrastive loss plus the teacher term): the term equals OpenCLIP's own
``DistillClipLoss``; every softmax backend with it, on 1-3 gloo ranks, torch and interpreted Triton (the fused
distillation kernels with ``infcl_triton``), in row blocks smaller than the batch, gives the value and the
contract gradients (features, scale) of the global loss against a float64 single-process dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss

from megabatch.losses import SigLipLoss, clip_loss_reference
from megabatch.losses import distill as distill_module
from megabatch.losses.distill import DistilledLoss, distill_loss_reference

from ..helpers import rel_error, run_ranks
from .test_contract import BACKENDS, SCALE, SIGMOID, TOLERANCE, backends

B_LOCAL, C, C_TEACHER, WEIGHT, TEACHER_SCALE = 13, 24, 40, 0.7, 23.0  # odd rows; a wider teacher


def global_inputs(world: int, dtype: torch.dtype):
    """Student features and a teacher's of the same samples: near the student's pairs, not equal."""
    generator = torch.Generator().manual_seed(5 + world)
    b = world * B_LOCAL

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    images = F.normalize(normal(b, C), dim=-1)
    texts = F.normalize(images + 0.9 * normal(b, C), dim=-1)
    teacher_images = F.normalize(normal(b, C_TEACHER), dim=-1)
    teacher_texts = F.normalize(teacher_images + 0.6 * normal(b, C_TEACHER), dim=-1)
    return [x.to(dtype) for x in (images, texts, teacher_images, teacher_texts)]


def reference(world: int, dtype: torch.dtype, contrastive: bool = True):
    images, texts, teacher_images, teacher_texts = (x.double() for x in global_inputs(world, dtype))
    images.requires_grad_(), texts.requires_grad_()
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    term = distill_loss_reference(images, texts, scale, teacher_images, teacher_texts, TEACHER_SCALE)
    loss = clip_loss_reference(images, texts, scale) + WEIGHT * term if contrastive else term
    loss.backward()
    return loss.detach(), images.grad, texts.grad, scale.grad


def results(rank: int, world: int, dtype: torch.dtype) -> dict:
    # ragged blocks of 5 rows, several a rank
    blocks, distill_module.BLOCK_ELEMENTS = distill_module.BLOCK_ELEMENTS, 5 * world * B_LOCAL
    try:
        return _results(rank, world, dtype)
    finally:
        distill_module.BLOCK_ELEMENTS = blocks


def _results(rank: int, world: int, dtype: torch.dtype) -> dict:
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    images, texts, teacher_images, teacher_texts = (x[rows] for x in global_inputs(world, dtype))
    out = {}
    for name in backends(dtype):
        if name in SIGMOID:
            continue
        inputs = [images.clone().requires_grad_(), texts.clone().requires_grad_()]
        scale = torch.tensor(SCALE, dtype=dtype, requires_grad=True)
        loss_fn = DistilledLoss(BACKENDS[name](), WEIGHT, TEACHER_SCALE)
        loss = loss_fn(inputs[0], inputs[1], scale, teacher=(teacher_images, teacher_texts))
        loss.backward()
        assert set(loss_fn.terms) == {"contrastive", "distill"}
        out[name] = (loss.detach(), *(x.grad for x in inputs), scale.grad)
    if "infcl_triton" in backends(dtype):  # the term alone in the fused kernels (beside hard negatives, say)
        inputs = [images.clone().requires_grad_(), texts.clone().requires_grad_()]
        scale = torch.tensor(SCALE, dtype=dtype, requires_grad=True)
        term = distill_module.distill_term(*inputs, scale, teacher_images, teacher_texts, TEACHER_SCALE,
                                           impl="triton", fp32_precision="ieee")
        term.backward()
        out["term_triton"] = (term.detach(), *(x.grad for x in inputs), scale.grad)
    return out


def check(world: int, dtype: torch.dtype, per_rank: list[dict]) -> None:
    loss_ref, d_images, d_texts, d_scale = reference(world, dtype)
    tolerance = TOLERANCE[dtype]
    names = [name for name in backends(dtype) if name not in SIGMOID]
    assert {"vanilla", "local", "disco", "infcl"} <= set(names)
    if "term_triton" in per_rank[0]:
        names.append("term_triton")
    for name in names:
        if name == "term_triton":
            loss_ref, d_images, d_texts, d_scale = reference(world, dtype, contrastive=False)
        for rank, result in enumerate(per_rank):
            loss, g_images, g_texts, _ = result[name]
            rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
            where = f"{name}, W={world}, rank {rank}, {dtype}"
            assert rel_error(loss, loss_ref) <= tolerance, f"loss value, {where}"
            assert rel_error(g_images, world * d_images[rows]) <= tolerance, f"image grad, {where}"
            assert rel_error(g_texts, world * d_texts[rows]) <= tolerance, f"text grad, {where}"
        mean_scale = torch.stack([r[name][3].double() for r in per_rank]).mean()
        assert rel_error(mean_scale, d_scale) <= tolerance, f"scale grad, {name}, W={world}"


def test_the_term_is_open_clips_distill_clip_loss():
    images, texts, teacher_images, teacher_texts = global_inputs(1, torch.float64)
    scale = torch.tensor(SCALE, dtype=torch.float64)
    theirs = DistillClipLoss()(images, texts, scale, teacher_images, teacher_texts,
                               torch.tensor(TEACHER_SCALE, dtype=torch.float64), output_dict=True)
    ours = distill_loss_reference(images, texts, scale, teacher_images, teacher_texts, TEACHER_SCALE)
    assert rel_error(ours, theirs["distill_loss"]) <= 1e-12
    # not vacuous: a teacher that agrees with the student's pairs less costs more
    shuffled = distill_loss_reference(images, texts, scale, teacher_images, teacher_texts.flip(0), TEACHER_SCALE)
    assert shuffled > ours + 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_distillation_on_one_process(dtype):
    check(1, dtype, [results(0, 1, dtype)])


def both_dtypes(rank: int, world: int) -> dict:
    return {dtype: results(rank, world, dtype) for dtype in TOLERANCE}


@pytest.mark.parametrize("world", [2, 3])
def test_distillation_on_several_ranks(world, tmp_path):
    per_rank = run_ranks(world, both_dtypes, tmp_path=tmp_path)
    for dtype in TOLERANCE:
        check(world, dtype, [result[dtype] for result in per_rank])


def test_weight_zero_is_the_contrastive_loss_and_the_sigmoid_loss_is_refused():
    images, texts, teacher_images, teacher_texts = global_inputs(1, torch.float64)
    scale = torch.tensor(SCALE, dtype=torch.float64)
    plain = BACKENDS["infcl"]()(images, texts, scale)
    assert torch.equal(DistilledLoss(BACKENDS["infcl"](), 0.0, TEACHER_SCALE)(
        images, texts, scale, teacher=(teacher_images, teacher_texts)), plain)
    with pytest.raises(ValueError, match="softmax loss"):
        DistilledLoss(SigLipLoss(impl="torch"), 1.0, TEACHER_SCALE)


def test_an_ensembles_target_is_the_mean_of_its_members_probabilities():
    """Teacher features ``[b, members, c]`` with a scale each (MobileCLIP's ensembles), in row blocks, against
    the members' softmaxes averaged by hand; one member is the plain term."""
    images, texts, teacher_images, teacher_texts = global_inputs(1, torch.float64)
    other_images, other_texts = global_inputs(2, torch.float64)[2:]
    members_images = torch.stack([teacher_images, other_images[:B_LOCAL]], 1)
    members_texts = torch.stack([teacher_texts, other_texts[:B_LOCAL]], 1)
    scales = (TEACHER_SCALE, 9.0)
    student = images @ texts.T * SCALE
    rows = sum((members_images[:, m] @ members_texts[:, m].T * scales[m]).softmax(1) for m in range(2)) / 2
    columns = sum((members_texts[:, m] @ members_images[:, m].T * scales[m]).softmax(1) for m in range(2)) / 2
    by_hand = (-(rows * student.log_softmax(1)).sum(1).mean() - (columns * student.T.log_softmax(1)).sum(1).mean()) / 2
    inputs = [x.clone().requires_grad_() for x in (images, texts, torch.tensor(SCALE, dtype=torch.float64))]
    blocks, distill_module.BLOCK_ELEMENTS = distill_module.BLOCK_ELEMENTS, 4 * B_LOCAL
    try:
        ours = distill_module.distill_term(*inputs, members_images, members_texts, scales)
        ours.backward()
    finally:
        distill_module.BLOCK_ELEMENTS = blocks
    assert rel_error(ours, by_hand) <= 1e-12
    dense = [x.clone().requires_grad_() for x in (images, texts, torch.tensor(SCALE, dtype=torch.float64))]
    reference_value = distill_loss_reference(*dense, members_images, members_texts, scales)
    reference_value.backward()
    assert rel_error(reference_value, by_hand) <= 1e-12
    for got, want in zip(inputs, dense, strict=True):
        assert rel_error(got.grad, want.grad) <= 1e-10
    one = distill_loss_reference(images, texts, SCALE, members_images[:, :1], members_texts[:, :1], scales[:1])
    plain = distill_loss_reference(images, texts, SCALE, teacher_images, teacher_texts, TEACHER_SCALE)
    assert rel_error(one, plain) <= 1e-12
