"""Hard negatives (``negatives=``): extra columns of the image->text direction. Every softmax backend,
on 1-3 gloo ranks, torch and interpreted Triton, gives the value and the contract gradients (features,
negatives, scale) of the global loss against a float64 single-process dense reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megabatch.losses import SigLipLoss, clip_loss_reference

from ..helpers import rel_error, run_ranks
from .test_contract import BACKENDS, SCALE, SIGMOID, TOLERANCE, backends

B_LOCAL, C, K = 13, 24, 3  # K hard negatives per sample: 39 a rank


def global_inputs(world: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(11 + world)
    images = F.normalize(torch.randn(world * B_LOCAL, C, generator=generator, dtype=torch.float64), dim=-1)
    texts = F.normalize(images + 0.8 * torch.randn(world * B_LOCAL, C, generator=generator, dtype=torch.float64),
                        dim=-1)
    # each sample's negatives near its text (hard): rows [i K, (i + 1) K) belong to sample i
    negatives = F.normalize(texts.repeat_interleave(K, 0) + 0.5 * torch.randn(world * B_LOCAL * K, C,
                                                                                generator=generator,
                                                                                dtype=torch.float64), dim=-1)
    return images.to(dtype), texts.to(dtype), negatives.to(dtype)


def reference(world: int, dtype: torch.dtype):
    images, texts, negatives = (x.double().requires_grad_() for x in global_inputs(world, dtype))
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    loss = clip_loss_reference(images, texts, scale, negatives)
    loss.backward()
    plain = clip_loss_reference(images.detach(), texts.detach(), scale.detach())
    assert loss > plain + 1e-3  # the negatives are in the softmax
    return loss.detach(), images.grad, texts.grad, negatives.grad, scale.grad


def results(rank: int, world: int, dtype: torch.dtype) -> dict:
    images, texts, negatives = global_inputs(world, dtype)
    rows, negative_rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL), slice(rank * B_LOCAL * K,
                                                                            (rank + 1) * B_LOCAL * K)
    out = {}
    for name in backends(dtype):
        if name in SIGMOID:
            continue
        inputs = [images[rows].clone().requires_grad_(), texts[rows].clone().requires_grad_(),
                  negatives[negative_rows].clone().requires_grad_()]
        scale = torch.tensor(SCALE, dtype=dtype, requires_grad=True)
        loss = BACKENDS[name]()(inputs[0], inputs[1], scale, negatives=inputs[2])
        loss.backward()
        out[name] = (loss.detach(), *(x.grad for x in inputs), scale.grad)
    return out


def check(world: int, dtype: torch.dtype, per_rank: list[dict]) -> None:
    loss_ref, d_images, d_texts, d_negatives, d_scale = reference(world, dtype)
    tolerance = TOLERANCE[dtype]
    names = [name for name in backends(dtype) if name not in SIGMOID]
    assert {"vanilla", "local", "disco", "infcl"} <= set(names)
    if dtype == torch.float32 and os.environ.get("TRITON_INTERPRET") == "1":
        assert "infcl_triton" in names  # the Triton kernels in the ring, interpreted
    for name in names:
        for rank, result in enumerate(per_rank):
            loss, g_images, g_texts, g_negatives, _ = result[name]
            rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
            negative_rows = slice(rank * B_LOCAL * K, (rank + 1) * B_LOCAL * K)
            where = f"{name}, W={world}, rank {rank}, {dtype}"
            assert rel_error(loss, loss_ref) <= tolerance, f"loss value, {where}"
            assert rel_error(g_images, world * d_images[rows]) <= tolerance, f"image grad, {where}"
            assert rel_error(g_texts, world * d_texts[rows]) <= tolerance, f"text grad, {where}"
            assert rel_error(g_negatives, world * d_negatives[negative_rows]) <= tolerance, f"negatives, {where}"
        mean_scale = torch.stack([r[name][4].double() for r in per_rank]).mean()
        assert rel_error(mean_scale, d_scale) <= tolerance, f"scale grad, {name}, W={world}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_negatives_on_one_process(dtype):
    check(1, dtype, [results(0, 1, dtype)])


def both_dtypes(rank: int, world: int) -> dict:
    return {dtype: results(rank, world, dtype) for dtype in TOLERANCE}


@pytest.mark.parametrize("world", [2, 3])
def test_negatives_on_several_ranks(world, tmp_path):
    per_rank = run_ranks(world, both_dtypes, tmp_path=tmp_path)
    for dtype in TOLERANCE:
        check(world, dtype, [result[dtype] for result in per_rank])


def test_the_sigmoid_loss_refuses_negatives():
    features = F.normalize(torch.randn(4, 8), dim=-1)
    with pytest.raises(ValueError, match="no hard negatives"):
        SigLipLoss(impl="torch")(features, features, torch.tensor(10.0), torch.tensor(-5.0), negatives=features)
