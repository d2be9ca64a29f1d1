"""Optimizer construction: parameter groups, batch-scaled learning rate."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from ...config import ConfigError, parse_count
from ...config.run import OptimSettings
from ...models.views import PARAMETERS as VIEW_PARAMETERS

log = logging.getLogger(__name__)


def scaled_lr(lr: float, rule: str | None, global_batch: int, base_batch: Any) -> float:
    """``lr`` scaled from ``base_batch`` to ``global_batch``: ``linear`` (x b/b0), ``sqrt``
    (x sqrt(b/b0)) or ``None`` (unchanged)."""
    if rule in (None, "none"):
        return lr
    ratio = global_batch / parse_count(base_batch, "optim.base_batch")
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise ConfigError(f"optim.lr_scaling={rule!r}; use null, linear or sqrt")


def decayed(name: str, param: torch.Tensor) -> bool:
    """Weight decay on matrices only: gains, biases, embeddings of rank 1 and logit_scale get none."""
    return not (param.ndim < 2 or "logit_scale" in name or name.endswith(".bias"))


# where a tower's blocks sit in its parameters' names: open_clip's transformers (resblocks), Hugging Face
# encoders (encoder.layer / layers), timm trunks (blocks, stages); the block's index follows
BLOCK = re.compile(r"\.(?:resblocks|layer|layers|blocks|stages)\.(\d+)\.")
# what sits below the first block: patch and token embeddings, positions, class tokens, the pre-norm
EMBEDDING = re.compile(r"embed|conv1|class_embedding|cls_emb|cls_token|ln_pre|patch_|pos_drop")
# the text tower's parameters that native open_clip CLIPs keep at the model's top level
TOP_LEVEL_TEXT = ("clip.token_embedding", "clip.positional_embedding", "clip.transformer.", "clip.ln_final",
                  "clip.text_projection", "clip.text_pool")


def tower_of(name: str) -> str | None:
    """``image``, ``text`` or ``None`` (the logit scale and bias, a caption decoder: outside both towers)."""
    if name.startswith("clip.visual."):
        return "image"
    if name.startswith("clip.text.") or name.startswith(TOP_LEVEL_TEXT):
        return "text"
    return None


def layer_depths(names: list[str]) -> dict[str, tuple[str | None, int, int]]:
    """Each parameter's ``(tower, depth, top)``: depth 0 for the embeddings, ``i + 1`` for block ``i``,
    ``top = layers + 1`` for what follows the last block (the final norm, the projection, an attention
    pool); outside a tower ``(None, 0, 0)``. Each tower counts from its own top."""
    layers: dict[str, int] = {}
    for name in names:
        tower, block = tower_of(name), BLOCK.search(name)
        if tower is not None and block is not None:
            layers[tower] = max(layers.get(tower, 0), int(block[1]) + 1)
    depths = {}
    for name in names:
        tower = tower_of(name)
        if tower is None:
            depths[name] = (None, 0, 0)
            continue
        top, block = layers.get(tower, 0) + 1, BLOCK.search(name)
        depth = int(block[1]) + 1 if block else 0 if EMBEDDING.search(name) else top
        depths[name] = (tower, depth, top)
    return depths


def hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A 2-D weight inside a tower's blocks (attention and MLP matrices): what Muon orthogonalises. The
    embeddings, the projections after the last block, norms, biases and the logit scale are not."""
    return param.ndim == 2 and tower_of(name) is not None and BLOCK.search(name) is not None


# the model's parameters that one objective alone trains, by name prefix (self_distill's heads): their own parameter
# groups (``"owner"``), whose weight decay the step holds at 0 until the objective trains them (``TrainStep.apply``;
# otherwise AdamW's decoupled decay shrinks them through the steps before it starts)
OWNED = (VIEW_PARAMETERS,)


def owner_of(name: str) -> str | None:
    return next((prefix for prefix in OWNED if name.startswith(prefix)), None)


def param_groups(model: nn.Module, weight_decay: float, layer_decay=None, split_matrices: bool = False) -> list[dict]:
    """Weight decay on matrices only (``decayed``). ``layer_decay`` (``optim.layer_decay``: null, or a
    decay per tower, ``{image: 0.75, text: null}``): each parameter's learning rate scaled by decay^(top
    - depth) of its tower (``layer_depths``), in a group per tower, depth and decay with its ``lr_scale``;
    the logit scale and bias, and a tower whose decay is null, keep the peak lr. Off: the two groups.
    ``split_matrices`` (``optim=muon``): each group split in two, its hidden matrices (``hidden_matrix``,
    ``"matrices": True``) and the rest. The parameters of ``OWNED`` in groups of their own, where there are any
    (marked with their ``owner`` and their configured ``decay``)."""
    params = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if not any(owner_of(name) for name, _ in params):
        return _groups(params, weight_decay, layer_decay, split_matrices)
    groups = []
    for owner in (None, *OWNED):
        for group in _groups([(n, p) for n, p in params if owner_of(n) == owner], weight_decay, layer_decay,
                             split_matrices):
            if group["params"] and owner is not None:
                kind = "decayed" if group["weight_decay"] else "not decayed"
                groups.append({**group, "owner": owner, "decay": group["weight_decay"],
                               "name": f"{owner.rstrip('.')}: {kind}" + (
                                   f" ({'Muon' if group['matrices'] else 'AdamW'})" if "matrices" in group else "")})
            elif group["params"]:
                groups.append(group)
    return groups


def _groups(params: list[tuple[str, nn.Parameter]], weight_decay: float, layer_decay,
            split_matrices: bool) -> list[dict]:
    """``param_groups`` of these named parameters."""
    if split_matrices:
        groups = []
        names = {id(param): name for name, param in params}
        for group in _groups(params, weight_decay, layer_decay, False):
            for matrices in (True, False):
                chosen = [p for p in group["params"] if hidden_matrix(names[id(p)], p) == matrices]
                if chosen:
                    name = group.get("name", "decayed" if group["weight_decay"] else "not decayed")
                    groups.append({**group, "params": chosen, "matrices": matrices,
                                   "name": f"{name} ({'Muon' if matrices else 'AdamW'})"})
        return groups
    if not layer_decay:
        return [{"params": [p for n, p in params if decayed(n, p)], "weight_decay": weight_decay},
                {"params": [p for n, p in params if not decayed(n, p)], "weight_decay": 0.0}]
    depths = layer_depths([name for name, _ in params])
    groups: dict[tuple, dict] = {}
    for name, param in params:
        tower, depth, top = depths[name]
        decay = layer_decay.get(tower) if tower is not None else None
        scale = float(decay) ** (top - depth) if decay else 1.0
        wd = weight_decay if decayed(name, param) else 0.0
        key = (tower or "-", depth if decay else top, wd)
        group = groups.setdefault(key, {"params": [], "weight_decay": wd, "lr_scale": scale,
                                        "name": f"{tower or 'scale/bias'}/" + (
                                            f"depth {depth} of {top}" if decay else "all")})
        group["params"].append(param)
    return [groups[key] for key in sorted(groups, key=lambda k: (k[0] == "-", k[0], k[1], -k[2]))]


def describe_param_groups(optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameter groups as a table for the log: name, parameters, lr scale, weight decay."""
    rows = ["| group | parameters | lr scale | weight decay |", "|---|---|---|---|"]
    for group in optimizer.param_groups:
        count = sum(p.numel() for p in group["params"])
        rows.append(f"| {group.get('name', '-')} | {count:,} | {group.get('lr_scale', 1.0):.4g} | "
                    f"{group['weight_decay']:g} |")
    return rows


def build_optimizer(optim: OptimSettings | DictConfig, model: nn.Module,
                    global_batch: int) -> tuple[torch.optim.Optimizer, float]:
    """The configured optimizer over ``model`` and its peak learning rate (``optim``: a run's ``OptimSettings``,
    or the ``optim`` config, parsed here)."""
    cfg = optim if isinstance(optim, OptimSettings) else OptimSettings.of(optim)
    lr = scaled_lr(cfg.lr, cfg.lr_scaling, global_batch, cfg.base_batch)
    if cfg.lr_scaling not in (None, "none"):
        log.info("lr %.3g scaled (%s) from base batch %s to %d: %.3g", cfg.lr, cfg.lr_scaling,
                 cfg.base_batch, global_batch, lr)
    factory = instantiate(cfg.optimizer, _convert_="all")  # plain lists in param_groups: checkpoints load weights_only
    kwargs = {}
    if "fused" not in cfg.optimizer and _takes_fused(factory) and next(model.parameters()).is_cuda:
        kwargs["fused"] = True  # one kernel for the whole update (CUDA); optim.optimizer.fused=false: foreach
    cls = getattr(factory, "func", factory)
    if cfg.optimizer.get("adamw_lr") is not None:  # optim=muon: AdamW's own peak lr, scaled as optim.lr is
        kwargs["adamw_lr"] = scaled_lr(float(cfg.optimizer.adamw_lr), cfg.lr_scaling, global_batch, cfg.base_batch)
    groups = param_groups(model, cfg.weight_decay, cfg.layer_decay,
                          split_matrices=getattr(cls, "splits_matrices", False))
    return factory(groups, lr=lr, **kwargs), lr


def timm_optimizer(params, lr: float, name: str, **kwargs) -> torch.optim.Optimizer:
    """``optim=timm``: timm's optimizer ``name`` (``optim.name``) over megabatch's parameter groups."""
    from timm.optim import create_optimizer_v2, list_optimizers

    if name not in list_optimizers():
        raise ConfigError(f"optim.name={name!r} is not one of timm's optimizers; e.g. optim.name=lamb, lion, "
                          "nadamw, lars or muon (timm.optim.list_optimizers() lists them)")
    return create_optimizer_v2(params, opt=name, lr=lr, **kwargs)


class MuonWithAdamW(torch.optim.Optimizer):
    """``optim=muon``: ``torch.optim.Muon`` on the towers' hidden matrices (``hidden_matrix``), AdamW on
    every other parameter (embeddings, projections, norms, biases, the logit scale and bias), as one
    optimizer: one set of ``param_groups`` (megabatch's, split by ``param_groups(split_matrices=True)``;
    the schedule sets their lr, times each one's ``lr_scale``), one ``state``, one state dict.
    ``adamw_lr``: AdamW's peak lr (``None``: ``lr``), applied through the AdamW groups' ``lr_scale``.
    ``adjust_lr_fn``: Muon's update scale, ``match_rms_adamw`` (Moonshot's: the lr and weight decay tuned
    for AdamW serve Muon too) or ``original`` (Keller Jordan's; Muon's lr then ~0.02)."""

    splits_matrices = True  # build_optimizer hands it the groups split into matrices and the rest

    def __init__(self, params, lr: float, adamw_lr: float | None = None, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = "match_rms_adamw",
                 adamw_betas: tuple[float, float] = (0.9, 0.98), adamw_eps: float = 1e-6):
        groups = [dict(group) for group in params]
        if any("matrices" not in group for group in groups):
            raise ValueError("MuonWithAdamW takes param_groups(..., split_matrices=True)'s groups")
        for group in groups:
            if not group["matrices"] and adamw_lr is not None:
                group["lr_scale"] = group.get("lr_scale", 1.0) * adamw_lr / lr
            group["lr"] = lr * group.get("lr_scale", 1.0)
        super().__init__(groups, {"lr": lr})
        muon = [group for group in self.param_groups if group["matrices"]]
        adamw = [group for group in self.param_groups if not group["matrices"]]
        # the inner optimizers hold the same group dicts and state: the schedule's lr reaches them
        self.muon = torch.optim.Muon(muon, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                     adjust_lr_fn=adjust_lr_fn) if muon else None
        self.adamw = torch.optim.AdamW(adamw, lr=lr, betas=tuple(adamw_betas), eps=adamw_eps) if adamw else None
        self._link()

    def _link(self) -> None:
        """Give the inner optimizers this one's groups and state (again after ``load_state_dict``, which
        replaces both)."""
        for inner, matrices in ((self.muon, True), (self.adamw, False)):
            if inner is not None:
                inner.param_groups = [group for group in self.param_groups if group["matrices"] == matrices]
                inner.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
        return loss


def _takes_fused(factory) -> bool:
    """Whether the configured optimizer class (a ``functools.partial``) has a ``fused`` option."""
    import inspect

    cls = getattr(factory, "func", factory)
    try:
        return "fused" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
