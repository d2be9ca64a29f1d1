"""``self_distill``'s student side: SigLIP 2's late objectives read an open_clip ViT on views of its images.

SILC's local-to-global self-distillation: the student encodes ``local_crops`` small crops of each image (at
``local_size`` pixels, the position embedding resized to their grid), and a head with prototypes (DINO's: an MLP, an
L2-normalised bottleneck, weight-normalised prototypes) turns each crop's pooled feature into logits over
``prototypes``; the EMA teacher's head, on the whole image, gives the target. TIPS's masked prediction: the student
encodes the image with a share ``mask_ratio`` of its patch tokens replaced by a learned mask token, and a second head
turns its last tokens at the masked places into logits; the target is the teacher's at the same places, unmasked.
The teacher, its center and the loss are the objective's (``train/step/objectives/self_distill.py``).

Which crops and which patches: drawn from a hash of each image's pixels and the step (``step``, set by the
objective), never from the RNG, so the same image gets the same views whatever sub-batch or rank it is in: one pass,
GradCache and several ranks give the same loss. The views run through the tower's own call (under FSDP its hooks
gather its weights), its embedding swapped for one that masks and resizes (``tower_tokens``).

``ViewHeads`` is a module of the ``ClipModel`` (``views.*`` in its state dict), rebuilt from the model's description;
``scripts/export.py``'s open_clip folder holds the CLIP alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError

# the prefix of the heads' parameter names in a ClipModel (``ClipModel.views``): self_distill trains them alone, from
# its start step (their own parameter groups: train/build/optim.OWNED)
PARAMETERS = "views."
MODULUS = 2147483647  # 2^31 - 1: the Lehmer generator's, products of two draws stay below 2^62


@dataclass(frozen=True)
class ViewsCfg:
    """The student's views and heads (``self_distill.*``'s model part): ``local_crops`` crops of ``local_size``
    pixels covering ``crop_scale`` of the image's area each, ``mask_ratio`` of the patch tokens masked, heads of
    ``hidden`` and ``bottleneck`` widths over ``prototypes``."""

    local_crops: int = 8
    local_size: int = 96
    crop_scale: tuple[float, float] = (0.05, 0.4)
    mask_ratio: float = 0.5
    prototypes: int = 4096
    hidden: int = 2048
    bottleneck: int = 256
    distill: bool = True   # the crops' head (self_distill.weight > 0)
    masked: bool = True    # the masked view's head (self_distill.masked_weight > 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "crop_scale": list(self.crop_scale)}

    @classmethod
    def of(cls, values) -> ViewsCfg | None:
        """The views a model's description holds (``None``: none)."""
        if not values:
            return None
        return cls(**{**dict(values), "crop_scale": tuple(float(v) for v in values["crop_scale"])})


class PrototypeHead(nn.Module):
    """DINO's head: an MLP to an L2-normalised ``bottleneck``, then cosine logits against ``prototypes``
    weight-normalised vectors."""

    def __init__(self, width: int, hidden: int, bottleneck: int, prototypes: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, bottleneck))
        self.prototypes = nn.Parameter(torch.randn(prototypes, bottleneck) * bottleneck ** -0.5)
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x).float(), dim=-1)
        return x @ F.normalize(self.prototypes.float(), dim=-1).t()


def image_hashes(images: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64 below ``MODULUS``: a hash of each image's pixels (a strided subset of at most 4,096 values of
    its uint8 pixels, or of its float pixels rounded to 1/1024): integer arithmetic, the same on every device and in
    any batch."""
    flat = images.flatten(1)
    flat = flat[:, ::max(1, flat.shape[1] // 4096)]
    values = flat.long() if not flat.is_floating_point() else (flat.float() * 1024).round().long()
    weights = torch.arange(1, flat.shape[1] + 1, device=flat.device) * 7919 % 65521 + 1
    return ((values % 65521) * weights).sum(1) % MODULUS


def uniforms(seeds: torch.Tensor, count: int) -> torch.Tensor:
    """``[n, count]`` in [0, 1): ``count`` draws per seed of ``seeds [n]`` (a Lehmer generator, three rounds from a
    start mixed from the seed and the draw's index)."""
    index = torch.arange(count, device=seeds.device)
    x = (seeds[:, None] * 16807 + index * 2654435 + 1) % MODULUS
    for _ in range(3):
        x = x * 48271 % MODULUS
    return x.double().div(MODULUS).float()


def resized_positions(positions: torch.Tensor, grid: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    """A ViT's ``[1 + gh x gw, width]`` position embedding (the class token's first) for a ``new`` grid: the patches'
    resized bicubically, the class token's as it is."""
    if tuple(grid) == tuple(new):
        return positions
    cls, patches = positions[:1], positions[1:]
    patches = patches.reshape(1, *grid, -1).permute(0, 3, 1, 2).float()
    patches = F.interpolate(patches, size=new, mode="bicubic", align_corners=False)
    return torch.cat([cls, patches.permute(0, 2, 3, 1).reshape(new[0] * new[1], -1).to(positions.dtype)])


def tower_tokens(visual: nn.Module, images: torch.Tensor, masked: torch.Tensor | None = None,
                 mask_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An open_clip ViT's pooled output and last tokens (after ``ln_post``, not projected) of normalised ``images``
    at any size its patches divide (the position embedding resized), with the patch tokens where ``masked
    [n, patches]`` is set replaced by ``mask_token``. Through the tower's own call: its embedding is swapped for the
    call (no patch dropout on these views)."""

    def embeds(x: torch.Tensor) -> torch.Tensor:
        x = visual.conv1(x)
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)
        if masked is not None:
            x = torch.where(masked[..., None], mask_token.to(x.dtype), x)
        cls = visual.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1)
        x = x + resized_positions(visual.positional_embedding, visual.grid_size, grid).to(x.dtype)
        return visual.ln_pre(x)

    visual._embeds, visual.output_tokens = embeds, True
    try:
        return visual(images)
    finally:
        del visual._embeds
        visual.output_tokens = False


class ViewHeads(nn.Module):
    """The student's views of a batch and the heads over them (the module's docstring). ``embed_dim``: the tower's
    pooled (projected) width, ``width``: its tokens', ``grid``: its patch grid, ``patch``: its patch size."""

    def __init__(self, cfg: ViewsCfg, embed_dim: int, width: int, grid: tuple[int, int], patch: int):
        super().__init__()
        self.cfg, self.grid, self.patch = cfg, tuple(grid), int(patch)
        self.image_head = PrototypeHead(embed_dim, cfg.hidden, cfg.bottleneck, cfg.prototypes) if cfg.distill \
            else None
        self.patch_head = PrototypeHead(width, cfg.hidden, cfg.bottleneck, cfg.prototypes) if cfg.masked else None
        self.mask_token = nn.Parameter(torch.zeros(width)) if cfg.masked else None
        # the step, for the draws: a tensor (a compiled caller reads it without recompiling)
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=False)

    @property
    def masked_count(self) -> int:
        """The patch tokens masked in each image."""
        return int(round(self.cfg.mask_ratio * self.grid[0] * self.grid[1])) if self.cfg.masked else 0

    def seeds(self, images: torch.Tensor) -> torch.Tensor:
        return (image_hashes(images) + self.step * 104729) % MODULUS

    def crops(self, images: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """``[n x local_crops, 3, s, s]``: each image's crops (area share in ``crop_scale``, aspect ratio in
        [3/4, 4/3], anywhere inside it), bilinearly resampled to ``local_size``, image by image."""
        cfg, rows = self.cfg, images.shape[0]
        size, count = cfg.local_size, cfg.local_crops
        draws = uniforms(seeds, 4 * count).reshape(rows, count, 4)
        low, high = cfg.crop_scale
        area = low + draws[..., 0] * (high - low)
        ratio = torch.exp(math.log(3 / 4) + draws[..., 1] * math.log(16 / 9))
        width, height = (area * ratio).sqrt().clamp(max=1.0), (area / ratio).sqrt().clamp(max=1.0)
        x = (width - 1) + draws[..., 2] * 2 * (1 - width)   # the crop's center in [-1, 1] coordinates
        y = (height - 1) + draws[..., 3] * 2 * (1 - height)
        # one grid per image: its crops stacked vertically, sampled in one call (no copy of the images)
        ys = (torch.arange(size, device=images.device) + 0.5) / size * 2 - 1
        grid_x = x[..., None, None] + width[..., None, None] * ys[None, None, None, :]
        grid_y = y[..., None, None] + height[..., None, None] * ys[None, None, :, None]
        grid = torch.stack(torch.broadcast_tensors(grid_x, grid_y), dim=-1)  # [n, count, s, s, 2]
        sampled = F.grid_sample(images.float(), grid.reshape(rows, count * size, size, 2), mode="bilinear",
                                padding_mode="border", align_corners=False)
        return sampled.reshape(rows, 3, count, size, size).transpose(1, 2).reshape(rows * count, 3, size, size)

    def masked_positions(self, seeds: torch.Tensor) -> torch.Tensor:
        """``[n, k]``: the patch tokens each image has masked (the ``k`` lowest of its draws), in order."""
        patches = self.grid[0] * self.grid[1]
        scores = uniforms(seeds * 31 % MODULUS, patches)
        return scores.argsort(dim=1, stable=True)[:, :self.masked_count].sort(dim=1).values

    def student(self, visual: nn.Module, images: torch.Tensor, normalized: torch.Tensor) -> dict[str, torch.Tensor]:
        """The student's logits: ``crops [n, local_crops, K]`` (the crops' pooled features through the image head)
        and ``masked [n, k, K]`` (the masked view's tokens at the masked places through the patch head), and the
        masked places ``positions [n, k]``; ``images``: as the loader gave them (the hash), ``normalized``: as the
        tower reads them."""
        seeds, out = self.seeds(images), {}
        if self.image_head is not None:
            pooled, _ = tower_tokens(visual, self.crops(normalized, seeds).to(normalized.dtype))
            out["crops"] = self.image_head(pooled).reshape(len(images), self.cfg.local_crops, -1)
        if self.patch_head is not None:
            positions = self.masked_positions(seeds)
            masked = torch.zeros((len(images), self.grid[0] * self.grid[1]), dtype=torch.bool, device=images.device)
            masked.scatter_(1, positions, True)
            _, tokens = tower_tokens(visual, normalized, masked, self.mask_token)
            out["masked"], out["positions"] = self.patch_head(take(tokens, positions)), positions
        return out

    def teacher(self, visual: nn.Module, normalized: torch.Tensor,
                positions: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The teacher's logits (this module and ``visual`` being the EMA teacher's): ``crops [n, K]`` of the whole
        image, ``masked [n, k, K]`` of its unmasked tokens at ``positions`` (where the student's were masked)."""
        pooled, tokens = tower_tokens(visual, normalized)
        out = {}
        if self.image_head is not None:
            out["crops"] = self.image_head(pooled)
        if self.patch_head is not None:
            out["masked"] = self.patch_head(take(tokens, positions))
        return out

    def untouched(self) -> torch.Tensor:
        """0, from every parameter: a forward without the views adds it, so that DDP sees the heads used (their
        gradients zero) before ``self_distill.start``."""
        return sum((p.reshape(-1)[:1] for p in self.parameters()), torch.zeros(1, device=self.step.device)).sum() * 0


def take(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``tokens [n, t, w]`` at ``positions [n, k]``: ``[n, k, w]``."""
    return tokens.gather(1, positions[..., None].expand(-1, -1, tokens.shape[-1]))


def check_views(cfg: ViewsCfg, visual: nn.Module, model_name: str) -> None:
    """The views ``cfg`` asks of ``visual``: an open_clip ViT with a class token whose patches divide
    ``local_size``; a ``ConfigError`` naming the key otherwise."""
    from open_clip.transformer import VisionTransformer

    if not isinstance(visual, VisionTransformer) or visual.attn_pool is not None:
        pooling = " with attention pooling" if isinstance(visual, VisionTransformer) else ""
        raise ConfigError(f"self_distill reads an open_clip ViT's tokens; model {model_name}'s image tower is a "
                          f"{type(visual).__name__}{pooling}: set self_distill.weight=0 and "
                          "self_distill.masked_weight=0")
    patch = visual.patch_size[0]
    if cfg.distill and (cfg.local_size % patch or cfg.local_size < patch):
        raise ConfigError(f"self_distill.local_size={cfg.local_size}: give a multiple of the image tower's patch size "
                          f"({patch}; SigLIP 2's B/16: 96)")
