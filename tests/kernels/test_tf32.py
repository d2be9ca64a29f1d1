"""TF32 dots round their fp32 operands to nearest (as cuBLAS does) instead of truncating: the
loss value stays within 10x of cuBLAS TF32's error against float64, for the softmax and the sigmoid
kernels. The rounding itself is checked on the CPU through the interpreter; the comparison with
cuBLAS needs a GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels import triton_tiles
from megabatch.losses import clip_loss_reference, siglip_loss_reference


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest TF32 (ties away from zero), emulated on the bits."""
    return ((x.view(torch.int32) + 0x1000) & -8192).view(torch.float32)


def features(b: int, c: int, seed: int, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(b, c, generator=generator, dtype=torch.float64), dim=-1)
    texts = F.normalize(images + torch.randn(b, c, generator=generator, dtype=torch.float64), dim=-1)
    return images.float().to(device), texts.float().to(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; the GPU test below covers CUDA")
def test_tf32_operands_are_rounded_to_nearest():
    rows, cols = features(40, 50, seed=1)
    scale, bias = torch.tensor(10.0), torch.tensor(-3.0)
    exact = triton_tiles.sigmoid_block(rows, cols, scale, bias, True, fp32_precision="ieee")[0]
    rounded = triton_tiles.sigmoid_block(rows, cols, scale, bias, True, fp32_precision="tf32")[0]
    emulated = triton_tiles.sigmoid_block(round_tf32(rows), round_tf32(cols), scale, bias, True,
                                          fp32_precision="ieee")[0]
    assert abs(float(rounded / emulated) - 1) <= 1e-6  # the kernel rounds exactly as emulated
    assert abs(float(rounded / exact) - 1) > 1e-7  # and it did round something
    assert torch.equal(round_tf32(torch.tensor([1.0, -2.5, 0.0])), torch.tensor([1.0, -2.5, 0.0]))
    ulp = 2.0**-10  # TF32's spacing at 1: halfway rounds away from zero, below it down
    assert round_tf32(torch.tensor([1 + ulp / 2, 1 + ulp / 2 - 2.0**-20])).tolist() == [1 + ulp, 1.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with cuBLAS TF32 on a GPU")
@pytest.mark.parametrize("b, c", [(1000, 100), (4096, 768), (12345, 1024)])
def test_tf32_loss_values_are_within_10x_of_cublas(b, c):
    images, texts = features(b, c, seed=b, device="cuda")
    scale = torch.tensor(100.0, device="cuda")
    truth = float(clip_loss_reference(images.double(), texts.double(), scale.double()))
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        cublas = abs(float(clip_loss_reference(images, texts, scale)) / truth - 1)
        ours = abs(float(triton_tiles.symmetric_loss(images, texts, scale, fp32_precision="tf32")) / truth - 1)
        sig_scale, sig_bias = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
        sig_truth = float(siglip_loss_reference(images.double(), texts.double(), sig_scale.double(),
                                                sig_bias.double()))
        sig_cublas = abs(float(siglip_loss_reference(images, texts, sig_scale, sig_bias)) / sig_truth - 1)
        sig_ours = abs(float(triton_tiles.sigmoid_block(images, texts, sig_scale, sig_bias, True,
                                                        fp32_precision="tf32")[0]) / b / sig_truth - 1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert ours <= max(10 * cublas, 1e-6), (ours, cublas)
    assert sig_ours <= max(10 * sig_cublas, 1e-6), (sig_ours, sig_cublas)
