"""``model.patch_gemm=true``: a ViT's patch embedding as one GEMM on the image's patches, not a
cuDNN convolution.

open_clip's ``VisionTransformer.conv1`` is a convolution whose stride equals its kernel: patches
that do not overlap, no padding, so a linear map of each patch. cuDNN runs it with a generic
convolution algorithm, far below the GPU's GEMM rate, and with its weight gradient it takes a share
of a ViT-B/32 step's GPU time many times its share of the FLOPs (the profile is in
docs/performance.md). ``PatchGemm.forward`` lays the patches out as rows
``[b, gh, gw, c * p * p]`` (one copy, which a compiled tower fuses with the images' normalisation)
and multiplies them by the kernel viewed as ``[width, c * p * p]``: one cuBLAS GEMM, and two in the
backward. It returns the convolution's ``[b, width, gh, gw]`` as a view that open_clip's flattening
turns into contiguous tokens without a copy.

The module keeps its parameters (its class changes), so state dicts, checkpoints and exports are
unchanged, and the features equal the convolution's up to the rounding of a reordered sum
(``tests/models/test_patches.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer
from torch import nn


class PatchGemm(nn.Conv2d):
    """A stride-equals-kernel ``nn.Conv2d`` computed as a GEMM on the input's patches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [b, c, h, w]`` -> ``[b, out, h // ph, w // pw]`` (a strided view); rows and columns
        past the last whole patch are dropped, as the convolution drops them."""
        batch, channels, height, width = x.shape
        ph, pw = self.kernel_size
        gh, gw = height // ph, width // pw
        if (gh * ph, gw * pw) != (height, width):
            x = x[:, :, :gh * ph, :gw * pw]
        patches = x.reshape(batch, channels, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(batch, gh, gw, channels * ph * pw)
        out = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.permute(0, 3, 1, 2)


def eligible(conv: nn.Module) -> bool:
    """Whether ``conv`` is a plain 2-d convolution over non-overlapping patches."""
    return (type(conv) is nn.Conv2d and conv.kernel_size == conv.stride and conv.padding == (0, 0)
            and conv.dilation == (1, 1) and conv.groups == 1)


def use_patch_gemm(model: nn.Module) -> int:
    """Turn the patch embedding of every open_clip ``VisionTransformer`` in ``model`` into a
    ``PatchGemm`` (in place, parameters kept). Returns how many were changed. Call before sharding
    or compiling."""
    changed = 0
    for module in model.modules():
        if isinstance(module, VisionTransformer) and eligible(module.conv1):
            module.conv1.__class__ = PatchGemm
            changed += 1
    return changed
