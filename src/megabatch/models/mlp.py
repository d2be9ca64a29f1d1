"""``model.fused_mlp=true``: the transformer blocks' MLPs (``c_fc``, exact ``nn.GELU``, ``c_proj``) run
through ``kernels/mlp.py``: the GELU computed in the epilogue of ``c_fc``'s GEMM, and its derivative in
the epilogue of the GEMM that gives the hidden gradient, instead of as kernels of their own.

The same function of the same parameters: ``mlp.c_fc`` and ``mlp.c_proj`` stay ``nn.Linear``
modules of the block (the state dict, checkpoints and exports are unchanged); the ``mlp`` module's
class changes, as ``model.direct_attention`` changes the attention block's. Under autocast the
input and the parameters are cast to autocast's dtype first, as ``nn.Linear`` would be.

Changed: open_clip ``ResidualAttentionBlock`` MLPs of the form ``Sequential(c_fc: Linear,
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
