"""Utilisation in the logs: the towers' FLOPs counted by torch's flop counter equal a count by hand,
a trained tower costs three forwards and a frozen one one, and GPUs find their peak in the table."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megabatch.models import build_model
from megabatch.train.step.utilization import (
    ModelFlops,
    Peak,
    attention_flop_formulas,
    count_model_flops,
    model_flop_formulas,
    table_peak,
    utilization,
)

from ..helpers import compose, interpreted_only


def transformer_layer(tokens: int, width: int, hidden: int) -> int:
    """Matmul FLOPs of one pre-norm transformer layer: q, k, v; scores and weighted sum; output; MLP."""
    return (2 * tokens * width * 3 * width + 4 * tokens * tokens * width + 2 * tokens * width * width
            + 2 * 2 * tokens * width * hidden)


def tiny_model_flops(device: torch.device, backend=None, *overrides: str) -> ModelFlops:
    """The tiny model's FLOPs on ``device`` (under bf16 autocast on CUDA, as training runs, so that the
    flash and cuDNN kernels can take the attention), its attention forced onto one SDPA ``backend`` if given."""
    model = build_model(compose("model=tiny", *overrides).model).to(device)  # configs/model/tiny.yaml
    with (sdpa_kernel(backend) if backend is not None else contextlib.nullcontext(),
          torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()):
        return count_model_flops(model, *model.example_inputs(4, device))


# Whatever kernel runs the attention (on CPU: the flash kernel, which torch 2.14's counter counted as
# 0 FLOPs, or the unfused matmuls), the count is the same.
@pytest.mark.parametrize("backend", [None, SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
def test_the_tiny_models_flops_equal_a_count_by_hand(backend):
    flops = tiny_model_flops(torch.device("cpu"), backend)
    patches, width = (32 // 8) ** 2, 96                 # 4 x 4 patches of 8 px, width 96
    image = (2 * patches * width * 3 * 8 * 8            # patch embedding (an 8x8 convolution)
             + 3 * transformer_layer(patches + 1, width, 192)  # 3 layers over 16 patches + the class token
             + 2 * width * 64)                           # projection of the class token to 64
    text = 2 * transformer_layer(16, 64, 128) + 2 * 64 * 64  # 2 layers over 16 tokens; projection of one
    assert flops.image_forward == image and flops.text_forward == text
    assert flops.per_sample == 3 * (image + text)  # forward + backward (twice the forward) per tower


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# not FLASH_ATTENTION: it takes no mask, and the text tower has one (the next test counts it alone)
@pytest.mark.parametrize("backend", [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])
def test_every_cuda_attention_kernel_counts_the_same(backend):
    expected = tiny_model_flops(torch.device("cpu"), SDPBackend.MATH)
    try:
        assert tiny_model_flops(torch.device("cuda"), backend) == expected
    except RuntimeError as error:  # this GPU or torch has no such kernel for these shapes
        if "No available kernel" not in str(error):
            raise
        pytest.skip(f"{backend.name} does not run here: {error}")


KERNELS = [("cpu", SDPBackend.MATH), ("cpu", SDPBackend.FLASH_ATTENTION)] + [
    pytest.param("cuda", backend, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA")])
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION)]


@pytest.mark.parametrize("device,backend", KERNELS)
def test_attention_counts_the_same_on_every_kernel_forward_and_backward(device, backend):
    """One attention without a mask (which every kernel takes): the forward's 2 matmuls, and the
    backward's 4 (gradients of q, k, v and the scores), as the unfused form counts; bf16 on CUDA."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(2, 3, 17, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    forward = 2 * 2 * 3 * 17 * 17 * (64 + 64)
    try:
        with sdpa_kernel(backend), FlopCounterMode(display=False, custom_mapping=attention_flop_formulas()) as counter:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            counted_forward = counter.get_total_flops()
            out.float().sum().backward()
    except RuntimeError as error:
        if "No available kernel" not in str(error):
            raise
        pytest.skip(f"{backend.name} does not run here: {error}")
    assert (counted_forward, counter.get_total_flops()) == (forward, 3 * forward)


@interpreted_only
@pytest.mark.parametrize("setting", ["model.attention=triton"])
def test_the_projects_kernels_count_as_the_matmuls_they_replace(setting):
    assert tiny_model_flops(torch.device("cpu"), None, setting) == tiny_model_flops(torch.device("cpu"))


def test_cublaslts_gelu_epilogue_counts_as_its_gemm():
    # model.gelu=tanh's forward without autograd on a GPU: aten._addmm_activation (CPU here: same op)
    x, weight, bias = torch.randn(6, 8), torch.randn(5, 8), torch.randn(5)
    counts = []
    for gemm in (lambda: torch.addmm(bias, x, weight.t()),
                 lambda: torch._addmm_activation(bias, x, weight.t(), use_gelu=True)):
        with FlopCounterMode(display=False, custom_mapping=model_flop_formulas()) as counter:
            gemm()
        counts.append(counter.get_total_flops())
    assert counts == [2 * 6 * 8 * 5] * 2


def test_a_frozen_tower_costs_its_forward_only():
    flops = ModelFlops(image_forward=10.0, text_forward=2.0, image_trained=False, text_trained=True)
    assert flops.per_sample == 10.0 + 3 * 2.0
    assert utilization(flops, Peak(100.0, "table"), samples_per_s_per_gpu=1e12) == {
        "model_tflops_per_gpu": 16.0, "mfu": 0.16}
    assert utilization(flops, None, 1e12) == {"model_tflops_per_gpu": 16.0}


@pytest.mark.parametrize("name,tflops", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                         ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
                                         ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0)])
def test_known_gpus_find_their_dense_bf16_peak(name, tflops):
    assert table_peak(name).tflops == tflops


def test_an_unknown_gpu_is_not_in_the_table():
    assert table_peak("Some Future Accelerator") is None  # gpu_peak then measures a bf16 matmul


def test_multihead_attentions_fused_path_counts_as_its_unfused_form():
    """``nn.MultiheadAttention`` in eval mode without autograd may run as one fused operator
    (``aten._native_multi_head_attention``: a frozen tower, a teacher): counted as the projections and attention its
    training path runs, not as nothing."""
    attention = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(3, 7, 16)
    with FlopCounterMode(display=False, custom_mapping=model_flop_formulas()) as unfused:
        attention(x, x, x, need_weights=False)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=model_flop_formulas()) as fused:
        torch._native_multi_head_attention(x, x, x, 16, 4, attention.in_proj_weight, attention.in_proj_bias,
                                           attention.out_proj.weight, attention.out_proj.bias, need_weights=False)
    assert unfused.get_total_flops() > 0
    assert fused.get_total_flops() == unfused.get_total_flops()
