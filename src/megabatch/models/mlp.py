"""The transformer blocks' MLPs (``c_fc``, exact ``nn.GELU``, ``c_proj``), computed another way.

``model.fused_mlp=true``: through ``kernels/mlp.py``, the GELU computed in the epilogue of ``c_fc``'s
GEMM, and its derivative in the epilogue of the GEMM that gives the hidden gradient, instead of as
kernels of their own. The same function.

``model.gelu=tanh`` (opt-in, not the same function): the tanh approximation of GELU, as cuBLASLt's
GEMM epilogue computes it. Where no backward follows (GradCache's graph-free pass, evaluation,
locked towers) on a GPU, ``c_fc`` and the GELU are one cuBLASLt call (``torch._addmm_activation``,
which inductor keeps as that call); with autograd, ``c_fc`` and then ``gelu(approximate="tanh")``
(cuBLASLt's epilogue keeps no pre-activation for a backward). A model trained so is evaluated and
exported the same way only by this project; open_clip itself computes the exact GELU.

The same function of the same parameters: ``mlp.c_fc`` and ``mlp.c_proj`` stay ``nn.Linear``
modules of the block (the state dict, checkpoints and exports are unchanged); the ``mlp`` module's
class changes, as ``model.direct_attention`` changes the attention block's. Under autocast the
input and the parameters are cast to autocast's dtype first, as ``nn.Linear`` would be.

Changed (both): open_clip ``ResidualAttentionBlock`` MLPs of the form ``Sequential(c_fc: Linear,
gelu: nn.GELU(approximate="none"), c_proj: Linear)`` with biases. Not: QuickGELU models (OpenAI's
weights), tanh GELU, SwiGLU or other MLPs, Hugging Face text towers (their own modules).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.mlp import fused_mlp


class FusedMlp(nn.Sequential):
    """An open_clip block's ``mlp`` computed by ``kernels.mlp.fused_mlp`` (see the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, proj = self.c_fc, self.c_proj
        params = (fc.weight, fc.bias, proj.weight, proj.bias)
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, params = x.to(dtype), tuple(p.to(dtype) for p in params)
        y = fused_mlp(x.reshape(-1, x.shape[-1]), *params)
        return y.view(*x.shape[:-1], y.shape[-1])


class TanhGeluMlp(nn.Sequential):
    """An open_clip block's ``mlp`` with the tanh GELU (``model.gelu=tanh``, see the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc = self.c_fc
        needs_graph = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in fc.parameters()))
        if not x.is_cuda or needs_graph or type(fc) is not nn.Linear:
            return self.c_proj(self.gelu(fc(x)))  # self.gelu.approximate is "tanh"
        weight, bias = fc.weight, fc.bias
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
        # cuBLASLt's GELU_BIAS epilogue (the tanh form; on the CPU this op computes the exact GELU)
        h = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return self.c_proj(h.view(*x.shape[:-1], h.shape[-1]))


def eligible(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is an open_clip block's plain ``c_fc -> exact GELU -> c_proj`` with biases."""
    if type(mlp) is not nn.Sequential or list(dict(mlp.named_children())) != ["c_fc", "gelu", "c_proj"]:
        return False
    fc, gelu, proj = mlp.c_fc, mlp.gelu, mlp.c_proj
    return (type(fc) is nn.Linear and type(proj) is nn.Linear and fc.bias is not None and proj.bias is not None
            and type(gelu) is nn.GELU and gelu.approximate == "none")


def use_fused_mlp(model: nn.Module) -> int:
    """Turn every eligible block MLP of ``model`` into a ``FusedMlp`` (in place, parameters kept).
    Returns how many were changed. Call before sharding or compiling."""
    changed = 0
    for module in model.modules():
        if eligible(module):
            module.__class__ = FusedMlp
            changed += 1
    return changed


def use_tanh_gelu(model: nn.Module) -> int:
    """Give every eligible block MLP of ``model`` the tanh GELU (``TanhGeluMlp``, in place, parameters
    kept). Returns how many were changed. Call before sharding or compiling."""
    changed = 0
    for module in model.modules():
        if eligible(module):
            module.__class__ = TanhGeluMlp
            module.gelu.approximate = "tanh"
            changed += 1
    return changed
