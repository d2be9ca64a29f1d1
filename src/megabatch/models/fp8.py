"""``model.fp8=true``: the towers' Linear layers train in FP8 through ``torchao.float8`` (PyTorch's
own float8 training library): each matmul's inputs are cast to float8 with a scale computed from
the tensor at hand (tensorwise dynamic scaling), run on the FP8 tensor cores, the output in bf16.

Opt-in and not exact (FP8 keeps 3 mantissa bits in the forward, 2 in the gradients). Within a step
it is still consistent: the scales come from the tensors alone, so GradCache's replay computes the
forward phase 1 computed. Needs a GPU with FP8 tensor cores (compute capability 8.9 or more: Ada,
Hopper, Blackwell) and torchao; pays with ``model.compile=true`` (inductor fuses the casts and the
scales into the neighbouring kernels; eager, the casts cost more than FP8 saves).

Converted: every trainable ``nn.Linear`` whose sizes are multiples of 16 (FP8 matmuls need them):
the MLPs and attention output projections of both towers. Not: open_clip attention's packed
``in_proj`` (a parameter, not a Linear), the patch embedding (a convolution), the projections
(matrices used directly), frozen towers (nothing to train, no gain) and the loss (fp32 features).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..config import ConfigError

log = logging.getLogger(__name__)


def check_fp8_device(device: torch.device) -> None:
    """A clear error where FP8 training cannot run: off CUDA, or on a GPU without FP8 tensor cores."""
    if device.type != "cuda":
        raise ConfigError(f"model.fp8=true trains the towers' matmuls in FP8 on the GPU's FP8 tensor cores; this "
                          f"run is on the {device.type.upper()}: set model.fp8=false")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(f"model.fp8=true needs FP8 tensor cores (compute capability 8.9 or more: H100, H200, L40S, "
                          f"B200); {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: set "
                          "model.fp8=false")


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """A trainable Linear whose sizes FP8 matmuls take (multiples of 16)."""
    return (isinstance(module, nn.Linear) and module.weight.requires_grad
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(model: nn.Module, device: torch.device) -> int:
    """Swap the eligible Linear layers of ``model`` for torchao's ``Float8Linear`` (same weights, in
    place; before the optimizer and any sharding). Returns how many were converted."""
    check_fp8_device(device)
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        raise ConfigError(f"model.fp8=true needs torchao (pip install torchao; {error})") from None
    eligible = [name for name, module in model.named_modules() if fp8_eligible(module, name)]
    if not eligible:
        raise ConfigError("model.fp8=true: no trainable Linear layer of this model has sizes FP8 takes "
                          "(multiples of 16); set model.fp8=false")
    convert_to_float8_training(model, module_filter_fn=fp8_eligible)
    return len(eligible)
