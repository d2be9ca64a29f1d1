"""Every loss backend, on 1-4 gloo ranks, gives the value and the contract gradients of the global
loss, checked against a float64 single-process dense reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megabatch.losses import (
    DiscoLoss,
    InfClLoss,
    LocalLoss,
    SigLipLoss,
    VanillaLoss,
    clip_loss_reference,
    siglip_loss_reference,
)

from ..helpers import rel_error, run_ranks

B_LOCAL, C, SCALE = 37, 24, 100.0
SIGLIP_SCALE, SIGLIP_BIAS = 10.0, -4.0  # SigLIP's range: sigmoids neither saturated nor flat
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}
BACKENDS = {
    "vanilla": lambda: VanillaLoss(),
    "local": lambda: LocalLoss(),
    "disco": lambda: DiscoLoss(),
    "infcl": lambda: InfClLoss(tile=16),  # 16 does not divide 37: ragged tiles on purpose
    # the Triton kernels in the ring, on these CPU tensors through TRITON_INTERPRET=1 (set by
    # conftest where there is no GPU; on a GPU machine tests/kernels runs them compiled); fp32 only
    "infcl_triton": lambda: InfClLoss(impl="triton", fp32_precision="ieee"),
    "siglip": lambda: SigLipLoss(impl="torch", tile=16),
    "siglip_triton": lambda: SigLipLoss(impl="triton", fp32_precision="ieee"),
}
FP32_ONLY = {"infcl_triton", "siglip_triton"}
SIGMOID = {"siglip", "siglip_triton"}  # called with a bias; held to the sigmoid reference


def backends(dtype: torch.dtype) -> list[str]:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return [name for name in BACKENDS
            if name not in FP32_ONLY or (dtype != torch.float64 and interpreted)]


def global_features(world: int, dtype: torch.dtype):
    """Normalised features of the global batch, rounded to ``dtype`` (the reference uses these)."""
    generator = torch.Generator().manual_seed(7 + world)
    images = F.normalize(torch.randn(world * B_LOCAL, C, generator=generator, dtype=torch.float64), dim=-1)
    texts = F.normalize(images + 0.8 * torch.randn(world * B_LOCAL, C, generator=generator,
                                                   dtype=torch.float64), dim=-1)
    return images.to(dtype), texts.to(dtype)


def reference(world: int, dtype: torch.dtype, sigmoid: bool = False):
    images, texts = (x.double().requires_grad_() for x in global_features(world, dtype))
    if sigmoid:
        scale = torch.tensor(SIGLIP_SCALE, dtype=torch.float64, requires_grad=True)
        bias = torch.tensor(SIGLIP_BIAS, dtype=torch.float64, requires_grad=True)
        loss = siglip_loss_reference(images, texts, scale, bias)
    else:
        scale, bias = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True), None
        loss = clip_loss_reference(images, texts, scale)
    loss.backward()
    return loss.detach(), images.grad, texts.grad, scale.grad, None if bias is None else bias.grad


def backend_results(rank: int, world: int, dtype: torch.dtype) -> dict:
    """On this rank: every backend's loss value and the gradients of its local inputs."""
    images, texts = global_features(world, dtype)
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    results = {}
    for name in backends(dtype):
        make = BACKENDS[name]
        local_images = images[rows].clone().requires_grad_()
        local_texts = texts[rows].clone().requires_grad_()
        if name in SIGMOID:
            scale = torch.tensor(SIGLIP_SCALE, dtype=dtype, requires_grad=True)
            bias = torch.tensor(SIGLIP_BIAS, dtype=dtype, requires_grad=True)
            loss = make()(local_images, local_texts, scale, bias)
        else:
            scale, bias = torch.tensor(SCALE, dtype=dtype, requires_grad=True), None
            loss = make()(local_images, local_texts, scale)
        loss.backward()
        results[name] = (loss.detach(), local_images.grad, local_texts.grad, scale.grad,
                         None if bias is None else bias.grad)
    return results


def check(world: int, dtype: torch.dtype, per_rank: list[dict]) -> None:
    references = {sigmoid: reference(world, dtype, sigmoid) for sigmoid in (False, True)}
    tolerance = TOLERANCE[dtype]
    for name in backends(dtype):
        loss_ref, d_images, d_texts, d_scale, d_bias = references[name in SIGMOID]
        for rank, results in enumerate(per_rank):
            loss, g_images, g_texts, *_ = results[name]
            rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
            where = f"{name}, W={world}, rank {rank}, {dtype}"
            assert rel_error(loss, loss_ref) <= tolerance, f"loss value, {where}"
            assert rel_error(g_images, world * d_images[rows]) <= tolerance, f"image grad, {where}"
            assert rel_error(g_texts, world * d_texts[rows]) <= tolerance, f"text grad, {where}"
        mean_scale = torch.stack([r[name][3].double() for r in per_rank]).mean()
        assert rel_error(mean_scale, d_scale) <= tolerance, f"scale grad, {name}, W={world}"
        if name in SIGMOID:
            mean_bias = torch.stack([r[name][4].double() for r in per_rank]).mean()
            assert rel_error(mean_bias, d_bias) <= tolerance, f"bias grad, {name}, W={world}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_process_without_a_group(dtype):
    check(1, dtype, [backend_results(0, 1, dtype)])


def all_dtypes(rank: int, world: int) -> dict:
    return {dtype: backend_results(rank, world, dtype) for dtype in TOLERANCE}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_spawned_ranks_match_the_reference(world, tmp_path):
    per_rank = run_ranks(world, all_dtypes, tmp_path=tmp_path)
    for dtype in TOLERANCE:
        check(world, dtype, [results[dtype] for results in per_rank])


def test_the_check_catches_a_missing_world_factor():
    """The contract check is not vacuous: DDP-style gradients without the factor W fail it."""
    per_rank = [backend_results(0, 1, torch.float64)]
    loss, g_i, g_t, g_s, g_b = per_rank[0]["vanilla"]
    per_rank[0]["vanilla"] = (loss, g_i / 2, g_t, g_s, g_b)
    with pytest.raises(AssertionError, match="image grad"):
        check(1, torch.float64, per_rank)


def test_the_check_catches_a_wrong_bias_gradient():
    """Negative control for the sigmoid loss: a bias gradient off by the diagonal's share fails."""
    per_rank = [backend_results(0, 1, torch.float64)]
    loss, g_i, g_t, g_s, g_b = per_rank[0]["siglip"]
    per_rank[0]["siglip"] = (loss, g_i, g_t, g_s, g_b * (1 + 1 / B_LOCAL))
    with pytest.raises(AssertionError, match="bias grad"):
        check(1, torch.float64, per_rank)


def unequal(rank: int, world: int) -> str:
    features = F.normalize(torch.randn(5 + rank, 8), dim=-1)
    messages = []
    for name, make in BACKENDS.items():
        try:
            make()(features, features, torch.tensor(10.0), *([torch.tensor(-1.0)] if name in SIGMOID else []))
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_unequal_rank_batches_are_a_clear_error(tmp_path):
    for messages in run_ranks(2, unequal, tmp_path=tmp_path):
        assert all("same batch on every rank" in m and "[5, 6]" in m for m in messages), messages
