"""The model card of an export (``README.md`` in the folder ``scripts/export.py`` writes): the Hugging Face Hub's
metadata block (``library_name: open_clip``, ``pipeline_tag: zero-shot-image-classification``, the license and
datasets where given), what the model is (architecture, sizes, parameters), how it was trained (data, batch,
steps, samples seen, loss and objectives, optimizer, recipe), its results table where the checkpoint has one
(``<ckpt>.results.csv``), and how to load it (``hf-hub:`` and ``local-dir:``). Everything comes from the
checkpoint's own record: its stored config, counters and the model it holds."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CARD_NAME = "README.md"


def training_config(state: dict[str, Any]) -> DictConfig:
    """The run's config as the checkpoint stored it (YAML text), or an empty one."""
    stored = state.get("config")
    if isinstance(stored, str):
        return OmegaConf.create(stored)
    return OmegaConf.create(stored or {})


def results_next_to(ckpt: Path) -> list[dict[str, str]]:
    """The rows of the checkpoint's results table (``<ckpt stem>.results.csv``, as ``eval/results.py`` writes it;
    empty without one)."""
    ckpt = Path(ckpt)
    for path in (ckpt.with_name(ckpt.stem + ".results.csv"), ckpt.with_name(ckpt.name + ".results.csv")):
        if path.is_file():
            with open(path, newline="") as handle:
                return list(csv.DictReader(handle))
    return []


def training_data(train) -> str:
    """The training data in words: its shard patterns (``data.train.urls``), or the embedded digits."""
    urls = train.get("urls")
    if not urls:
        return "the embedded digits (scikit-learn's 1,797 handwritten digits, captioned)"
    urls = list(urls) if not isinstance(urls, str) else [urls]
    return ", ".join(f"`{url}`" for url in urls)


def objectives(cfg: DictConfig) -> list[str]:
    """The training terms the config turned on, in words."""
    loss = cfg.get("loss") or {}
    target = str(loss.get("_target_", "?")).rsplit(".", 1)[-1]
    terms = [f"contrastive loss `{target}`" + (f" (weight {loss.contrastive_weight})"
                                               if float(loss.get("contrastive_weight", 1.0)) != 1.0 else "")]
    if float(loss.get("caption_weight", 0.0)) > 0:
        warmup = float(loss.get("caption_warmup", 0.0))
        terms.append(f"caption loss (weight {loss.caption_weight}" +
                     (f", reached after the first {warmup:.0%} of the steps)" if warmup > 0 else ")"))
    distill = cfg.get("distill") or {}
    if distill.get("teacher"):
        terms.append(f"distillation from `{distill.teacher}`")
    train = (cfg.get("data") or {}).get("train") or {}
    if train.get("negatives_key"):
        terms.append(f"{train.get('negatives', 1)} hard negative(s) a sample (`{train.negatives_key}`)")
    return terms


def model_card(model, state: dict[str, Any], rows: list[dict[str, str]], *, repo_id: str | None = None,
               license: str | None = None, datasets: tuple[str, ...] = ()) -> str:
    """The card's Markdown text for ``model`` (a ``ClipModel``) exported from the checkpoint ``state``."""
    cfg = training_config(state)
    meta = ["---", "library_name: open_clip", "pipeline_tag: zero-shot-image-classification",
            "tags:", "- clip", "- megabatch"]
    if license:
        meta.append(f"license: {license}")
    if datasets:
        meta += ["datasets:", *[f"- {name}" for name in datasets]]
    meta.append("---")
    parameters = sum(p.numel() for p in model.clip.parameters())
    image = sum(p.numel() for p in model.clip.visual.parameters())
    size = model.image_size if isinstance(model.image_size, int) else "x".join(map(str, model.image_size))
    train = state.get("train_state") or {}
    data = ((cfg.get("data") or {}).get("train") or {})
    samples = train.get("samples_seen")
    lines = [*meta, "", f"# {repo_id or model.name}", "",
             f"A CLIP model (`{model.arch or model.name}`) trained with megabatch and exported in open_clip's "
             "format.", "", "## Model", "",
             "| | |", "|---|---|",
             f"| architecture | `{model.arch or model.name}` (megabatch model `{model.name}`) |",
             f"| parameters | {parameters / 1e6:.1f}M ({image / 1e6:.1f}M image tower) |",
             f"| embedding width | {model.model_cfg.get('embed_dim', '?')} |",
             f"| image size | {size} |",
             f"| preprocessing | mean {model.preprocess['mean']}, std {model.preprocess['std']}, "
             f"{model.preprocess.get('interpolation', '?')} |", "",
             "## Training", "", "| | |", "|---|---|",
             f"| data | {training_data(data)} |",
             f"| global batch | {state.get('global_batch', cfg.get('batch', '?'))} |",
             f"| steps | {state.get('step', '?')} |",
             f"| samples seen | {samples if samples is not None else '?'} |",
             f"| objectives | {'; '.join(objectives(cfg))} |"]
    optim = cfg.get("optim") or {}
    if optim:
        target = (optim.get("optimizer") or {}).get("_target_") or optim.get("_target_") or "?"
        lines.append(f"| optimizer | `{optim.get('name') or str(target).rsplit('.', 1)[-1]}`, "
                     f"lr {optim.get('lr', '?')}, weight decay {optim.get('weight_decay', '?')} |")
    if cfg.get("recipe"):
        lines.append(f"| recipe | `experiment={cfg.recipe}` |")
    lines += ["", "## Results", ""]
    if rows:
        lines += ["| set | task | metric | value |", "|---|---|---|---|"]
        lines += [f"| {row['set']} | {row['task']} | {row['metric']} | {float(row['value']):.2f} |" for row in rows]
    else:
        lines.append("Not evaluated (no results table beside the checkpoint: `scripts/evaluate.py ckpt=...` writes "
                     "one).")
    source = f"hf-hub:{repo_id}" if repo_id else "hf-hub:<org>/<name>"
    lines += ["", "## Use", "", "```python", "import open_clip", "",
              f"model, _, preprocess = open_clip.create_model_and_transforms('{source}')",
              f"tokenizer = open_clip.get_tokenizer('{source}')",
              "# or from this folder: open_clip.create_model_and_transforms('local-dir:<folder>')", "```", ""]
    return "\n".join(lines)


def write_model_card(out: Path, model, state: dict[str, Any], ckpt: Path, **options) -> Path:
    """``README.md`` in the export folder ``out``; returns its path."""
    path = Path(out) / CARD_NAME
    path.write_text(model_card(model, state, results_next_to(ckpt), **options))
    return path
