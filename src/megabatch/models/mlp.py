"""The transformer blocks' MLPs (``c_fc``, exact ``nn.GELU``, ``c_proj``) with the tanh GELU.

``model.gelu=tanh`` (opt-in, not the same function): the tanh approximation of GELU, as cuBLASLt's
GEMM epilogue computes it. Where no backward follows (GradCache's graph-free pass, evaluation,
locked towers) on a GPU, ``c_fc`` and the GELU are one cuBLASLt call (``torch._addmm_activation``,
which inductor keeps as that call); with autograd, ``c_fc`` and then ``gelu(approximate="tanh")``
(cuBLASLt's epilogue keeps no pre-activation for a backward). The model's open_clip config records
it (``act_kwargs={"approximate": "tanh"}`` in the changed towers' configs), so a checkpoint's or an
export's description rebuilds the tanh GELU, in ``scripts/evaluate.py`` and in open_clip itself.

The same parameters: ``mlp.c_fc`` and ``mlp.c_proj`` stay ``nn.Linear``
modules of the block (the state dict, checkpoints and exports are unchanged); the ``mlp`` module's
class changes, as ``model.direct_attention`` changes the attention block's. Under autocast the
input and the parameters are cast to autocast's dtype first, as ``nn.Linear`` would be.

Changed: open_clip ``ResidualAttentionBlock`` MLPs of the form ``Sequential(c_fc: Linear,
gelu: nn.GELU(approximate="none"), c_proj: Linear)`` with biases (also those already
``approximate="tanh"``). Not: QuickGELU models (OpenAI's weights), SwiGLU or other MLPs,
Hugging Face text towers (their own modules).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError


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


def eligible(mlp: nn.Module, approximate: tuple[str, ...] = ("none",)) -> bool:
    """Whether ``mlp`` is an open_clip block's plain ``c_fc -> GELU -> c_proj`` with biases, its GELU's
    ``approximate`` one of ``approximate`` (the exact one by default)."""
    if type(mlp) is not nn.Sequential or list(dict(mlp.named_children())) != ["c_fc", "gelu", "c_proj"]:
        return False
    fc, gelu, proj = mlp.c_fc, mlp.gelu, mlp.c_proj
    return (type(fc) is nn.Linear and type(proj) is nn.Linear and fc.bias is not None and proj.bias is not None
            and type(gelu) is nn.GELU and gelu.approximate in approximate)


def use_tanh_gelu(model: nn.Module) -> int:
    """Give every eligible block MLP of ``model`` (a ``ClipModel``, or any module) the tanh GELU
    (``TanhGeluMlp``, in place, parameters kept) and, for a ``ClipModel``, record it in the changed
    towers' open_clip config. Returns how many were changed; a ``ClipModel`` with none to change is a
    ``ConfigError``. Call before sharding or compiling."""
    changed = {}
    for name, module in model.named_modules():
        if eligible(module, approximate=("none", "tanh")):
            module.__class__ = TanhGeluMlp
            module.gelu.approximate = "tanh"
            tower = "vision_cfg" if ".visual." in f".{name}." else "text_cfg"
            changed[tower] = changed.get(tower, 0) + 1
    config = getattr(model, "model_cfg", None)
    if config is not None:
        if not changed:
            raise ConfigError("model.gelu=tanh: this model's blocks have no GELU MLP to change (QuickGELU, "
                              "SwiGLU or Hugging Face blocks): set model.gelu=erf")
        for tower in changed:  # what a checkpoint's description rebuilds (open_clip's act_kwargs)
            config[tower]["act_kwargs"] = {**(config[tower].get("act_kwargs") or {}), "approximate": "tanh"}
    return sum(changed.values())
