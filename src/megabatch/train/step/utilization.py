"""How well a run uses its GPUs: model FLOPs per sample, counted once at start-up, and the GPU's
dense bf16 peak, so that every logged step says its model TFLOP/s per GPU and its MFU.

Model FLOPs are those of the towers' matrix products (``torch.utils.flop_counter``: matmuls,
convolutions, attention), counted on one forward of one sub-batch. Attention counts the same
whichever SDPA kernel runs: torch's counter knows the CUDA flash, efficient and cuDNN kernels but
not every kernel of every version (torch 2.14's CPU flash kernel counted 0), so
``attention_flop_formulas`` gives each SDPA operator it lacks the unfused form's count. A trained
tower costs three times its forward (forward, and a backward of twice its FLOPs), a frozen one its
forward. GradCache's graph-free first encoding is not counted (like activation recomputation, it is
work the method adds, not work the model needs), nor is the loss; MFU is then comparable across
sub-batch sizes and with other trainers' MFU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from the vendors' data sheets. The first
# name found in torch.cuda.get_device_name() wins: the more specific ones come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H100", 989.4), ("H200", 989.4),
    ("H800", 989.4), ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
    ("RTX 4090", 165.2), ("RTX 6000 Ada", 364.2),
)


@dataclass(frozen=True)
class Peak:
    """A device's dense bf16 peak and where the figure comes from (``table`` or ``measured``)."""

    tflops: float
    source: str


def gpu_peak(device: torch.device) -> Peak | None:
    """The peak of ``device`` from the table, else measured (a large bf16 matmul, the best of a few:
    a lower bound of the true peak, so MFU reads high); ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    return table_peak(torch.cuda.get_device_name(device)) or Peak(measure_matmul_tflops(device),
                                                                  "measured (bf16 8192^3 matmul)")


def table_peak(name: str) -> Peak | None:
    """The table's peak for a device named ``name`` (``torch.cuda.get_device_name``), if listed."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return Peak(tflops, f"table ({key})")
    return None


def measure_matmul_tflops(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """bf16 ``size^3`` matmul TFLOP/s on ``device``, the best of ``repeats``."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up cuBLAS
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs per sample of each tower, and which towers train."""

    image_forward: float
    text_forward: float
    image_trained: bool
    text_trained: bool

    @property
    def per_sample(self) -> float:
        """Model FLOPs of one training sample: 3 x forward for a trained tower, 1 x for a frozen one."""
        return (self.image_forward * (3 if self.image_trained else 1)
                + self.text_forward * (3 if self.text_trained else 1))


# Every fused scaled-dot-product-attention operator, forward and backward; q, k, v are the first three
# arguments of a forward, the gradient of the output then q, k, v those of a backward. torch.ops.aten
# lists the ones this torch has.
SDPA_FORWARD = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps")
SDPA_BACKWARD = tuple(f"{name}_backward" for name in SDPA_FORWARD[:-1])


def attention_forward_flops(query: torch.Size, key: torch.Size, value: torch.Size) -> int:
    """Matmul FLOPs of attention over ``query [b, h, s_q, d]``, ``key [b, h_kv, s_k, d]``, ``value [b,
    h_kv, s_k, d_v]``: the scores (2 s_q s_k d) and their weighted sum of the values (2 s_q s_k d_v)
    per query head, as the unfused form's two batched matmuls count (causal masking not discounted)."""
    batch, heads, queries, depth = query
    keys, value_depth = key[-2], value[-1]
    return 2 * batch * heads * queries * keys * (depth + value_depth)


def _forward_formula(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return attention_forward_flops(query, key, value)


def _backward_formula(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * attention_forward_flops(query, key, value)  # gradients of q, k, v and the scores: 4 matmuls


def attention_flop_formulas() -> dict:
    """Formulas for ``FlopCounterMode(custom_mapping=...)`` so that attention counts the same on every
    kernel: the forward of each SDPA operator torch's counter lacks (its own formulas are the same
    count), and the backward of every one. torch counts the fused kernels' backward as 5 matmuls (the
    scores recomputed) but the unfused form's as 4; model FLOPs leave recomputation out, as they leave
    out activation checkpointing, so every backward counts 4 (twice the forward)."""
    from torch.utils.flop_counter import flop_registry

    formulas = {}
    for name in SDPA_FORWARD:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and packet not in flop_registry and packet.default not in flop_registry:
            formulas[packet] = _forward_formula
    for name in SDPA_BACKWARD:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            formulas[packet] = _backward_formula
    return formulas


def _native_attention_formula(query, key, value, embed_dim, num_head, *args, out_shape=None, **kwargs) -> int:
    """``nn.MultiheadAttention``'s fused path (a module in eval mode without autograd: a frozen tower, a teacher, an
    evaluation): the query, key, value and output projections and the attention, as its unfused form counts them.
    ``query [b, s_q, e]``, ``key`` and ``value [b, s_k, e]``."""
    batch, queries, width = query
    keys, depth = key[1], width // num_head
    projections = 2 * batch * width * width * (2 * queries + 2 * keys)
    each = (batch, num_head, queries, depth)
    return projections + attention_forward_flops(each, (batch, num_head, keys, depth), (batch, num_head, keys, depth))


def _addmm_formula(bias, mat1, mat2, *args, out_shape=None, **kwargs) -> int:
    return 2 * mat1[0] * mat1[1] * mat2[1]


def _packed_attention_formula(qkv, *args, out_shape=None, **kwargs) -> int:
    batch, length, _, heads, depth = qkv
    each = (batch, heads, length, depth)  # q, k and v alike
    return attention_forward_flops(each, each, each)


def model_flop_formulas() -> dict:
    """``attention_flop_formulas`` and the forwards torch's counter does not know, so that every
    ``model.*`` setting counts the model's FLOPs alike: cuBLASLt's GEMM with its GELU epilogue
    (``model.gelu=tanh``: ``aten._addmm_activation``, counted as ``addmm``), the project's attention
    kernels (``model.attention=triton|auto``) and ``nn.MultiheadAttention``'s fused path in eval mode (a frozen
    tower without ``model.direct_attention``: it escaped the count, 103.8 of ViT-L/14's 162.0 GFLOP counted), as
    the matmuls they replace."""
    from ...kernels import attention  # noqa: F401  (registers the custom op)

    return {**attention_flop_formulas(), torch.ops.aten._addmm_activation: _addmm_formula,
            torch.ops.megabatch.packed_attention: _packed_attention_formula,
            torch.ops.aten._native_multi_head_attention: _native_attention_formula}


def count_model_flops(model, images: torch.Tensor, texts: torch.Tensor) -> ModelFlops:
    """Count the towers' forward FLOPs on one sub-batch (``images [n, 3, s, s]``, ``texts [n,
    ctx]``), without autograd, in the model's current mode (training: the attention's training
    path). Returns them per sample. The parameters are counted with ``requires_grad`` off: a view of a parameter
    made under ``no_grad`` (timm's attention-pooling latent, ``expand``ed) still says it requires grad, without a
    gradient function, and the counter's module tracker refuses such an input."""
    counts = {}
    trainable = [param for param in model.parameters() if param.requires_grad]
    try:
        for param in trainable:
            param.requires_grad_(False)
        with torch.no_grad():
            for tower, encode, inputs in (("image", model._image_features, images),
                                          ("text", model._text_features, texts)):
                with FlopCounterMode(display=False, custom_mapping=model_flop_formulas()) as counter:
                    encode(inputs)
                counts[tower] = counter.get_total_flops() / len(inputs)
    finally:
        for param in trainable:
            param.requires_grad_(True)
    return ModelFlops(counts["image"], counts["text"], not model.frozen("image"), not model.frozen("text"))


def utilization(flops: ModelFlops | None, peak: Peak | None, samples_per_s_per_gpu: float) -> dict[str, float]:
    """The metrics of one log interval: ``model_tflops_per_gpu`` and, with a peak, ``mfu``."""
    if flops is None:
        return {}
    achieved = flops.per_sample * samples_per_s_per_gpu / 1e12
    metrics = {"model_tflops_per_gpu": achieved}
    if peak is not None:
        metrics["mfu"] = achieved / peak.tflops
    return metrics
