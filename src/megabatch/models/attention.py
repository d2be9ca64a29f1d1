"""``model.direct_attention=true``: open_clip's attention blocks call SDPA on views of their packed
projection instead of going through ``nn.MultiheadAttention``.

``nn.MultiheadAttention``'s training path (``F.multi_head_attention_forward``) works sequence-first:
a batch-first input is transposed, the packed q/k/v projection is split with a copy, the heads are
laid out with another, and the output is made contiguous and transposed back, each copy again in
the backward. On a ViT-B/16 sub-batch these copies and transposes are several percent of the GPU
time. ``DirectAttentionBlock.attention`` computes the same function with the same parameters
(``attn.in_proj_weight``, ``attn.in_proj_bias``, ``attn.out_proj``) on views: one projection
``[b, s, 3e]`` viewed as ``[b, s, 3, h, d]``, q/k/v as strided ``[b, h, s, d]`` views, SDPA, and one
transpose before the output projection. State dicts, checkpoints and exports are unchanged (the block's
class changes, not its parameters), and the features equal the module's up to the rounding of a
reordered sum (tests/models/test_attention.py).

``model.attention=triton``: the attention itself runs in the project's Triton kernels
(``kernels/attention.py``), which read q, k and v from the packed projection and give the output as
``[b, s, e]`` and the gradient packed, with no layout copies either way. A block of a causally masked
text tower runs the causal kernel; a block given any other mask, or with attention dropout in
training, keeps SDPA. ``model.attention=auto`` picks per call from the kernels' measured table
(``kernels.attention.faster_than_sdpa``): the Triton kernels where a backward follows on long
sequences, SDPA for forwards without autograd, short sequences and on the CPU. ``auto`` is the
default: measured faster end to end at ViT-B/16 and ViT-L/14 (docs/performance.md).

Only self-attention blocks of open_clip's ``ResidualAttentionBlock`` with a plain batch-first
``nn.MultiheadAttention`` are changed (no ``bias_k``/``bias_v``, no ``add_zero_attn``, one embedding
size for q/k/v); cross-attention (CoCa's decoder), attentional pooling and open_clip's own
``CustomResidualAttentionBlock`` (which already calls SDPA) keep theirs. A NaFlex tower's timm attention
modules become ``naflex.LengthsAttention``: the same choice of kernel, given each image's sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from open_clip.transformer import ResidualAttentionBlock
from torch import nn

from ..kernels.attention import faster_than_sdpa, packed_attention
from .naflex import NaFlexTower

KERNELS = ("auto", "sdpa", "triton")  # model.attention


class DirectAttentionBlock(ResidualAttentionBlock):
    """An open_clip ``ResidualAttentionBlock`` whose self-attention calls SDPA, or the Triton kernels,
    directly (see the module)."""

    kernel = "sdpa"       # model.attention: auto | sdpa | triton (use_direct_attention sets it per block)
    causal_mask = False   # a mask given to this block is its tower's causal mask (open_clip's text tower)

    def attention(self, q_x: torch.Tensor, k_x: torch.Tensor | None = None, v_x: torch.Tensor | None = None,
                  attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``q_x [b, s, e]`` -> ``[b, s, e]``; ``attn_mask [s, s]`` additive (open_clip's causal mask), or
        ``[b x heads, s, s]`` (CoCa's text tower: its class token's mask of each sample's padding)."""
        if k_x is not None or v_x is not None:  # cross-attention: the module's own path
            return super().attention(q_x, k_x, v_x, attn_mask)
        attn = self.attn
        batch, length, width = q_x.shape
        heads = attn.num_heads
        qkv = F.linear(q_x, attn.in_proj_weight, attn.in_proj_bias).view(batch, length, 3, heads, width // heads)
        dropout = attn.dropout if self.training else 0.0
        per_sample = attn_mask is not None and attn_mask.dim() == 3  # CoCa's text: causal and padding, per sample
        if self.kernel != "sdpa" and dropout == 0.0 and (attn_mask is None or self.causal_mask and not per_sample) \
                and (self.kernel == "triton" or faster_than_sdpa(qkv)):
            out = packed_attention(qkv, causal=attn_mask is not None)  # [b, s, h, d]: [b, s, e] as it is
            return attn.out_proj(out.view(batch, length, width))
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [b, h, s, d] views of the one projection
        mask = attn_mask.to(q_x.dtype) if attn_mask is not None else None  # as open_clip's attention() casts it
        if per_sample:  # [b x heads, s, s], each sample's mask repeated for its heads: [b, heads, s, s]
            mask = mask.view(batch, heads, length, length)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return attn.out_proj(out.transpose(1, 2).reshape(batch, length, width))


def eligible(block: nn.Module) -> bool:
    """Whether ``block`` is a plain open_clip self-attention block that ``DirectAttentionBlock`` computes."""
    attn = getattr(block, "attn", None)
    return (type(block) is ResidualAttentionBlock and isinstance(attn, nn.MultiheadAttention)
            and attn.batch_first and attn._qkv_same_embed_dim and attn.bias_k is None and not attn.add_zero_attn
            and not hasattr(block, "ln_1_kv"))


def use_direct_attention(model: nn.Module, kernel: str = "sdpa") -> int:
    """Turn every eligible block of ``model`` into a ``DirectAttentionBlock`` (in place, parameters
    kept) computing its attention with ``kernel`` (``model.attention``: auto, sdpa or triton). Returns
    how many were changed. Call before sharding or compiling."""
    if kernel not in KERNELS:  # a config's value is checked with the others (config/schema.py)
        raise ValueError(f"kernel={kernel!r}: give one of {KERNELS}")
    causal = causal_blocks(model)
    changed = 0
    for module in model.modules():
        if eligible(module):
            module.__class__ = DirectAttentionBlock
            module.kernel, module.causal_mask = kernel, id(module) in causal
            changed += 1
        elif isinstance(module, NaFlexTower):
            changed += module.use_lengths_attention(kernel)
    return changed


def causal_blocks(model: nn.Module) -> set[int]:
    """``id``s of the blocks of open_clip text towers whose mask is their causal ``attn_mask``
    (``CLIP`` and ``TextTransformer``; not a tower that masks padding, whose masks differ per caption)."""
    blocks: set[int] = set()
    for module in model.modules():
        transformer = getattr(module, "transformer", None)
        if isinstance(getattr(module, "attn_mask", None), torch.Tensor) and isinstance(transformer, nn.Module) \
                and not getattr(module, "use_pad_mask", False):
            blocks |= {id(block) for block in transformer.modules()}
    return blocks
