"""Tile computations of the contrastive loss. Each kernel sits beside a plain-torch reference of
the same math; kernels know nothing of losses or process groups."""

from .tiles import block_grads, block_lse

__all__ = ["block_grads", "block_lse"]
