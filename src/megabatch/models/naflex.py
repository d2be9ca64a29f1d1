"""``model.image.naflex``: a NaFlex image tower (timm's ``NaFlexVit``: each image at its own aspect ratio and
resolution, as a sequence of patches with their grid coordinates and a validity mask; learned position
embeddings resized per image) inside megabatch's CLIP, with any text tower.

``NaFlexTower`` has open_clip's ``TimmModel`` layout (``trunk``, ``head.drop``, ``head.proj``), so its weights
are those of the open_clip config ``vision_cfg: {timm_model_name: <variant>, timm_pool: "", timm_proj:
"linear"}`` (``NaFlexCfg.vision_cfg``): a model at a timm variant's own sizes exports to a folder open_clip's
released package loads (it then feeds the tower square images, which ``NaFlexVit`` also takes). The sizes come
from the usual keys (``patch_size``, ``width``, ``layers``, ``head_width``, ``mlp_ratio``), the variant's the rest.

Training feeds it the packed patches ``data/naflex.py`` makes (uint8 ``[n, L, 3 p^2 + 4]``,
``kernels/packed_patches.py``): the tower unpacks them on the device, normalised with the model's mean and std.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version
from timm.layers import Attention as TimmAttention
from timm.models.naflexvit import NaFlexEmbeds
from torch import nn

from ..config import ConfigError
from ..kernels.attention import faster_than_sdpa, packed_attention
from ..kernels.packed_patches import grid_example, unpack
from ..kernels.resample import resample_matrices

# the oldest timm whose NaFlexVit the tests pass with (requirements.txt's floor): 1.0.16's patch dropout mismatched
# its mask by the register tokens, 1.0.18's variants could not be built on the meta device (the export's check)
TIMM_FLOOR = "1.0.21"

def grid_sizes_in_one_copy(coord: torch.Tensor) -> list[tuple[int, int]]:
    """Each image's patch grid ``(rows, columns)`` from its patches' coordinates ``[n, L, 2]``, as timm's
    ``calculate_naflex_grid_sizes`` gives it, read to the host in one copy: timm reads two scalars an image
    (``.item()``), 2,048 waits on the GPU a forward of 1,024 images, each stalling the queue of kernels behind it."""
    sizes = torch.stack([coord[:, :, 0].amax(dim=1), coord[:, :, 1].amax(dim=1)], dim=1) + 1
    return [(int(rows), int(columns)) for rows, columns in sizes.tolist()]


def read_grids_in_one_copy() -> None:
    """timm's NaFlexVit finds the grids (its position embeddings' sizes, per image) with ``grid_sizes_in_one_copy``:
    the same sizes, one host sync a forward (set on timm's module, where its methods look the function up)."""
    from timm.models import naflexvit

    if naflexvit.calculate_naflex_grid_sizes is not grid_sizes_in_one_copy:
        TIMMS["calculate_naflex_grid_sizes"] = naflexvit.calculate_naflex_grid_sizes  # kept: the tests compare
        naflexvit.calculate_naflex_grid_sizes = grid_sizes_in_one_copy


TIMMS: dict = {}  # timm's functions read_grids_in_one_copy replaced

class PositionsOnDevice(NaFlexEmbeds):
    """timm's ``NaFlexEmbeds`` (``NaFlexTower`` sets its class, ``place_positions_on_device``) whose learned position
    embeddings, resized to each image's grid as timm resizes them (``F.interpolate`` of the table, antialiased, per
    distinct grid size, then ``index_add_`` of those images), are one product for all patches: each patch's row
    of the separable resize (``kernels/resample.py``'s matrices for each image's rows and columns) against the
    table. Same values to rounding
    (in float32, as timm's), with no host sync and no loop over grid sizes: a sub-batch of cropped images has
    dozens, each a host copy, an interpolation and an ``index_add_`` in timm's; the tower compiles as one graph."""

    def _apply_learned_naflex_pos_embed(self, x: torch.Tensor, patch_coord: torch.Tensor) -> None:
        n, length = patch_coord.shape[:2]
        rows, columns = self.pos_embed.shape[1:3]
        grid = patch_coord.amax(dim=1) + 1  # [n, 2]: each image's (rows, columns), as timm finds them
        valid = torch.arange(length, device=x.device) < grid.prod(dim=1, keepdim=True)  # timm adds to rows < h w
        if self.pos_embed_ar_preserving:  # a square grid of the longer side, then cropped
            grid = grid.amax(dim=1, keepdim=True).expand_as(grid)
        along = []
        for axis, side in enumerate((rows, columns)):  # [n, length, side]: each image's resize, a patch's row of it
            zero, whole = torch.zeros(n, device=x.device), torch.full((n,), side, device=x.device)
            resize = resample_matrices(zero, whole, side, grid[:, axis], self.pos_embed_interp_mode, torch.float32,
                                       taps_per_pixel=side, rows=length)  # (a grid side is at most the length)
            along.append(resize.gather(1, patch_coord[..., axis, None].expand(-1, -1, side)))
        weights = (along[0][..., :, None] * (along[1] * valid[..., None])[..., None, :]).flatten(2)
        with torch.autocast(x.device.type, enabled=False):
            x.add_((weights @ self.pos_embed.reshape(rows * columns, -1).float()).to(x.dtype))


def place_positions_on_device(embeds: nn.Module) -> bool:
    """``embeds`` (timm's ``NaFlexEmbeds``) becomes ``PositionsOnDevice`` where its settings are what
    ``resample_matrices`` computes (learned, not grid_sample, antialiased bilinear or bicubic, no aligned corners);
    else it keeps timm's path. Whether it did."""
    if type(embeds) not in (NaFlexEmbeds, PositionsOnDevice) or embeds.pos_embed_type != "learned" \
            or getattr(embeds, "pos_embed_use_grid_sample", False) \
            or embeds.pos_embed_interp_mode not in ("bilinear", "bicubic") \
            or not getattr(embeds, "pos_embed_antialias", True) or getattr(embeds, "pos_embed_align_corners", False):
        return False
    embeds.__class__ = PositionsOnDevice
    return True


DEFAULT_VARIANT = "naflexvit_base_patch16_gap"
WEIGHT_INITS = ("", "jax", "jax_nlhb", "moco")  # timm's NaFlexVit.init_weights modes (model.image.weight_init)
# model.image keys that have no meaning for a NaFlex tower (open_clip ViT options), refused naming the key
OPEN_CLIP_ONLY = ("layers_per_block", "attentional_pool", "attn_pooler_queries",
                  "attn_pooler_heads", "no_ln_pre", "pos_embed_type", "final_ln_after_pool", "pool_type",
                  "output_tokens", "act_kwargs", "norm_kwargs", "block_type", "qk_norm", "scaled_cosine_attn",
                  "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc", "timm_model_pretrained",
                  "timm_pool", "timm_proj", "timm_proj_bias", "timm_drop", "timm_drop_path", "timm_model_name",
                  "hf_model_name", "hf_model_pretrained", "hf_proj_type", "hf_pooler_type", "hf_tokenizer_name",
                  "embed_cls", "output_dim", "pos_embed_type")


@dataclass(frozen=True)
class NaFlexCfg:
    """A NaFlex tower: timm's ``variant`` (a ``naflexvit_*`` name: its pooling, registers, layer scale ...) at
    these sizes. ``image_size``: the square size of evaluation's fixed-size images and of the position
    embeddings' grid (``image_size / patch_size`` a side); ``max_seq_len``: the most patches an image becomes in
    training (``data.naflex.seq_lens`` draws lengths up to it) and in evaluation (``eval.<name>.seq_len``)."""

    variant: str = DEFAULT_VARIANT
    image_size: int = 256
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    head_width: int = 64
    mlp_ratio: float = 4.0
    max_seq_len: int = 256
    patch_dropout: float = 0.0
    ls_init_value: float | None = None  # layer scale's initial value; None: the variant's; 0: no layer scale
    proj: str = "linear"                # linear: a projection to the shared embedding; none: the pooled output is it
    weight_init: str = ""               # timm's scheme: "" (normal, std 0.02), jax (Xavier: big_vision's), moco

    @classmethod
    def of(cls, image: Mapping[str, Any]) -> NaFlexCfg:
        """The ``model.image`` keys of a NaFlex tower (``naflex`` itself removed); an open_clip ViT's own
        option is a ``ConfigError`` naming it."""
        values = dict(image)
        variant = values.pop("variant", None) or DEFAULT_VARIANT
        for key in OPEN_CLIP_ONLY:
            if values.get(key) not in (None, False, 0, {}, ""):
                raise ConfigError(f"model.image.{key} is an open_clip ViT's option; a NaFlex tower "
                                  f"(model.image.naflex=true) does not take it: remove it")
            values.pop(key, None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"model.image.{unknown[0]}: not a NaFlex tower's key ({', '.join(sorted(known))})")
        cfg = cls(variant=str(variant), **values)
        if not str(cfg.variant).startswith("naflexvit_"):
            raise ConfigError(f"model.image.variant={cfg.variant!r}: give one of timm's naflexvit_* models "
                              f"(e.g. {DEFAULT_VARIANT}, naflexvit_base_patch16_siglip)")
        if cfg.width % cfg.head_width:
            raise ConfigError(f"model.image.width={cfg.width} is not a multiple of model.image.head_width="
                              f"{cfg.head_width}")
        if cfg.image_size % cfg.patch_size:
            raise ConfigError(f"model.image.image_size={cfg.image_size} is not a multiple of "
                              f"model.image.patch_size={cfg.patch_size}")
        if cfg.max_seq_len < 1:
            raise ConfigError(f"model.image.max_seq_len={cfg.max_seq_len}: give at least one patch")
        if cfg.weight_init not in WEIGHT_INITS:
            raise ConfigError(f"model.image.weight_init={cfg.weight_init!r}: give one of timm's schemes "
                              f"{', '.join(repr(mode) for mode in WEIGHT_INITS)}")
        if cfg.proj not in ("linear", "none"):
            raise ConfigError(f"model.image.proj={cfg.proj!r}: linear (a projection to model.embed_dim) or none (the "
                              "pooled output is the embedding: SigLIP 2's towers)")
        return cfg

    @classmethod
    def of_open_clip(cls, vision_cfg: Mapping[str, Any], overrides: Mapping[str, Any] = ()) -> NaFlexCfg | None:
        """The NaFlex tower of an open_clip ``vision_cfg`` naming a timm ``naflexvit_*`` model (OpenCLIP's main
        branch: ``naflex_ViT-B-16``, ``ViT-B-16-SigLIP2-naflex``, the Hugging Face hub's folders of them), else
        ``None``: the variant at timm's own sizes (read off it, built on the meta device, as open_clip's
        ``TimmModel`` builds it), its projection as ``timm_proj`` says, ``max_seq_len`` from ``image_seq_len`` (OpenCLIP
        main's key) or the image's patches, ``patch_dropout`` as open_clip's; ``overrides``: ``model.image``'s NaFlex
        keys (``max_seq_len``, ``ls_init_value``). Pooling other than the variant's is a ``ConfigError``."""
        variant = str(vision_cfg.get("timm_model_name") or "")
        if not variant.startswith("naflexvit_"):
            return None
        import timm

        with torch.device("meta"):
            trunk = timm.create_model(variant, pretrained=False, num_classes=0)
        pool, proj = vision_cfg.get("timm_pool", "avg"), vision_cfg.get("timm_proj", "linear") or "none"
        # TimmModel keeps the variant's pooling for "" only where a projection follows (else "" means none)
        pooled_as_ours = pool == trunk.global_pool or (pool == "" and proj == "linear")
        if not pooled_as_ours or proj not in ("linear", "none") or vision_cfg.get("timm_proj_bias"):
            raise ConfigError(f"vision_cfg {dict(vision_cfg)}: a NaFlex tower pools as timm's {variant} does "
                              f"(timm_pool: {trunk.global_pool!r}) and projects with a linear layer without bias or "
                              "not at all (timm_proj: linear or none); this config's tower is not one megabatch builds")
        patch, width = int(trunk.embeds.patch_size[0]), int(trunk.num_features)
        image_size = int(trunk.embeds.pos_embed.shape[1]) * patch  # the position embeddings' grid
        values = dict(variant=variant, image_size=image_size, patch_size=patch, width=width, layers=len(trunk.blocks),
                      head_width=width // trunk.blocks[0].attn.num_heads,
                      mlp_ratio=trunk.blocks[0].mlp.fc1.out_features / width, proj=proj,
                      patch_dropout=float(vision_cfg.get("patch_dropout") or 0.0),
                      max_seq_len=int(vision_cfg.get("image_seq_len") or
                                      (int(vision_cfg.get("image_size") or image_size) // patch) ** 2))
        return cls.of({**values, **dict(overrides)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    def trunk_kwargs(self) -> dict[str, Any]:
        """timm's keywords over the variant's config: these sizes, no classifier."""
        return {"num_classes": 0, "patch_size": self.patch_size, "embed_dim": self.width, "depth": self.layers,
                "num_heads": self.width // self.head_width, "mlp_ratio": self.mlp_ratio,
                "pos_embed_grid_size": (self.grid, self.grid), "img_size": self.image_size,
                "patch_drop_rate": self.patch_dropout,
                **({"init_values": self.ls_init_value} if self.ls_init_value else {}),
                **({"weight_init": self.weight_init} if self.weight_init else {})}

    def vision_cfg(self, pool: str = "") -> dict[str, Any]:
        """open_clip's ``vision_cfg`` of the same weights' layout (``TimmModel``): what an export records. ``pool``:
        the variant's pooling, which ``TimmModel`` passes as it is where no projection follows (``""`` keeps the
        variant's where one does)."""
        return {"timm_model_name": self.variant, "timm_model_pretrained": False,
                "timm_pool": "" if self.proj == "linear" else pool, "timm_proj": self.proj, "timm_proj_bias": False,
                "image_size": self.image_size, "patch_size": self.patch_size, "width": self.width,
                "layers": self.layers, "head_width": self.head_width, "mlp_ratio": self.mlp_ratio}


def why_not_open_clip(tower: NaFlexTower) -> str | None:
    """Why open_clip's released package cannot rebuild ``tower`` from its ``vision_cfg`` (``TimmModel`` makes the
    variant at timm's own sizes): a parameter of another shape than the variant's (built on the meta device, no
    memory), or ``None`` where it can."""
    import timm

    with torch.device("meta"):
        reference = timm.create_model(tower.cfg.variant, pretrained=False, num_classes=0)
    shapes = {name: tuple(param.shape) for name, param in reference.state_dict().items()}
    for name, param in tower.trunk.state_dict().items():
        if shapes.get(name) != tuple(param.shape):
            return (f"its NaFlex tower is not timm's {tower.cfg.variant} at its own sizes (trunk.{name}: "
                    f"{tuple(param.shape)} against {shapes.get(name)}), which is what open_clip's TimmModel builds "
                    "from the exported config")
    return None


class LengthsAttention(TimmAttention):
    """timm's self-attention (a NaFlex tower's blocks) computed as ``DirectAttentionBlock``'s, and given each
    image's sequence length instead of a mask: ``attn_mask`` an integer ``[b]`` (``NaFlexTower`` passes it: the
    registers and each image's valid patches come first, padding after). The kernels then skip the padding's
    blocks (``packed_attention(lengths=)``: no query sees a padding key, padding rows are zero); SDPA, where it
    runs instead, gets the key mask of those lengths (FlashAttention takes no mask: cuDNN's or the memory-efficient
    kernel runs). Either way each valid token's output is the one timm's own mask gives (which also masks padding
    queries, whose rows then differ: no valid token, pooling or loss reads them)."""

    kernel = "sdpa"  # model.attention, as DirectAttentionBlock's

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        lengths = attn_mask if attn_mask is not None and attn_mask.dim() == 1 else None
        if (attn_mask is not None and lengths is None) or is_causal:
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        batch, length, _ = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        qkv = self.qkv(x).view(batch, length, 3, heads, head_dim)
        if self._kernel_runs(qkv, lengths):
            out = packed_attention(qkv, lengths=lengths).reshape(batch, length, heads * head_dim)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
            mask = None if lengths is None else \
                (torch.arange(length, device=x.device) < lengths[:, None])[:, None, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 dropout_p=self.attn_drop.p if self.training else 0.0)
            out = out.transpose(1, 2).reshape(batch, length, heads * head_dim)
        out = self.norm(out)
        gate = getattr(self, "gate", None)  # timm >= 1.0.26's gated attention
        if gate is not None:
            out = out * gate(x).sigmoid()
        return self.proj_drop(self.proj(out))

    def _kernel_runs(self, qkv: torch.Tensor, lengths: torch.Tensor | None) -> bool:
        """The kernels, not SDPA: never with q/k norms or attention dropout in training; ``triton`` always;
        ``auto`` on a GPU for a sequence with padding (SDPA's masked kernel is the slower one) and as
        ``faster_than_sdpa`` measured otherwise."""
        if self.kernel == "sdpa" or not isinstance(self.q_norm, nn.Identity) \
                or not isinstance(self.k_norm, nn.Identity) or (self.training and self.attn_drop.p > 0):
            return False
        if self.kernel == "triton":
            return True
        if lengths is not None:
            return qkv.is_cuda and qkv.shape[-1] <= 128
        return faster_than_sdpa(qkv)


class NaFlexTower(nn.Module):
    """timm's ``NaFlexVit`` (``trunk``) and a linear projection to the shared embedding (``head.proj``), in
    open_clip's ``TimmModel`` layout. ``forward`` takes the packed patches (uint8 ``[n, L, 3 p^2 + 4]``,
    normalised by ``unpack``) or, as ``NaFlexVit`` does, square float images ``[n, 3, s, s]``."""

    def __init__(self, cfg: NaFlexCfg, embed_dim: int):
        super().__init__()
        import timm

        self.cfg = cfg
        if Version(timm.__version__) < Version(TIMM_FLOOR):
            raise ConfigError(f"model.image.naflex=true needs timm >= {TIMM_FLOOR} (installed: {timm.__version__}; "
                              "1.0.16-1.0.20 fail with patch dropout or on the meta device): pip install -U timm")
        if not timm.is_model(cfg.variant):
            raise ConfigError(f"model.image.variant={cfg.variant}: timm {timm.__version__} has no such model "
                              f"(megabatch's NaFlex towers are tested with timm {TIMM_FLOOR} and 1.0.31): pip install "
                              "-U timm, or give one of timm.list_models('naflexvit_*')")
        self.trunk = timm.create_model(cfg.variant, pretrained=False, **cfg.trunk_kwargs())
        if cfg.ls_init_value == 0:  # no layer scale: timm takes init_values=None as "the variant's", not as none
            for block in self.trunk.blocks:
                block.ls1, block.ls2 = nn.Identity(), nn.Identity()
        read_grids_in_one_copy()
        self.positions_on_device = place_positions_on_device(self.trunk.embeds)
        if cfg.proj == "none" and self.trunk.num_features != embed_dim:
            raise ConfigError(f"model.image.proj=none: the NaFlex tower's pooled output ({self.trunk.num_features} "
                              f"wide) is the embedding, and model.embed_dim is {embed_dim}; set model.embed_dim="
                              f"{self.trunk.num_features}, or model.image.proj=linear")
        self.head = nn.Sequential(OrderedDict(drop=nn.Dropout(0.0),
                                              proj=nn.Linear(self.trunk.num_features, embed_dim, bias=False))) \
            if cfg.proj == "linear" else nn.Sequential()
        self.image_size = (cfg.image_size, cfg.image_size)
        self.patch_size = (cfg.patch_size, cfg.patch_size)
        self.lengths = False  # the blocks take each image's sequence length (use_lengths_attention), not a mask

    @property
    def blocks(self) -> nn.Sequential:
        return self.trunk.blocks

    def vision_cfg(self) -> dict[str, Any]:
        """open_clip's ``vision_cfg`` of this tower's layout (``NaFlexCfg.vision_cfg`` with the trunk's pooling)."""
        return self.cfg.vision_cfg(self.trunk.global_pool)

    def use_lengths_attention(self, kernel: str) -> int:
        """``model.direct_attention``: the blocks' attention becomes ``LengthsAttention`` computing with ``kernel``
        (``model.attention``), and the tower passes it each image's sequence length instead of timm's mask
        (``[n, 1, L, L]``, which keeps SDPA off FlashAttention and the kernels off). Every block's or none (a
        variant with rope or other attention keeps timm's). Returns how many modules changed."""
        attentions = [getattr(block, "attn", None) for block in self.trunk.blocks]
        if not attentions or any(type(attn) not in (TimmAttention, LengthsAttention) for attn in attentions):
            return 0
        for attn in attentions:
            attn.__class__, attn.kernel = LengthsAttention, kernel
        self.lengths = True
        return len(attentions)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype == torch.uint8 and images.dim() == 3:
            preprocess = self.preprocess_cfg  # open_clip's set_model_preprocess_cfg sets it on the image tower
            images = unpack(images, self.cfg.patch_size, preprocess["mean"], preprocess["std"])
            if self.lengths and not (self.training and self.trunk.patch_drop is not None):
                # unpack's valid patches lead each row (patch dropout would shuffle them: timm's mask then)
                images["attn_mask"] = images["patch_valid"].sum(1, dtype=torch.int32) + self.trunk.num_prefix_tokens
        return self.head(self.trunk(images))

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        """Freeze the tower but its last ``unlocked_groups`` blocks and what follows them (the final norm, the
        pooling, the projection), as open_clip's ``lock`` does."""
        self.requires_grad_(False)
        if unlocked_groups:
            for block in list(self.trunk.blocks)[-unlocked_groups:]:
                block.requires_grad_(True)
            for name, module in self.trunk.named_children():
                if name not in ("embeds", "blocks", "patch_drop", "norm_pre", "rope"):
                    module.requires_grad_(True)
            self.head.requires_grad_(True)

    def example_inputs(self, rows: int, seq_len: int | None = None) -> torch.Tensor:
        """``rows`` packed images of ``seq_len`` (default ``max_seq_len``) patches: the training input's shape."""
        return grid_example(rows, self.cfg.patch_size, seq_len or self.cfg.max_seq_len)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.trunk.set_grad_checkpointing(enable)

