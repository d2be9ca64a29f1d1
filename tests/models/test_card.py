"""Every export holds a model card (issue 86, item 1): the Hub's metadata, the model, how it was trained and scored,
and how to load it; ``push=<org/name>`` uploads the folder, and without a token stops before anything is written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import torch

from ..helpers import ROOT, compose


def checkpoint(tmp_path, *overrides: str) -> tuple:
    """A megabatch checkpoint of the tiny model, as a run writes it (its config stored as YAML)."""
    from omegaconf import OmegaConf

    from megabatch.models import build_model

    cfg = compose(*overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    path = tmp_path / "last.pt"
    torch.save({"model": {f"clip.{k}": v for k, v in model.clip.state_dict().items()}, "step": 120,
                "global_batch": 4096, "config": OmegaConf.to_yaml(cfg), "open_clip": model.description(),
                "train_state": {"step": 120, "samples_seen": 491520}}, path)
    return path, model


def export_script():
    spec = importlib.util.spec_from_file_location("export_script", ROOT / "scripts" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_card_says_what_the_model_is_how_it_was_trained_and_scored(tmp_path, capsys):
    ckpt, _ = checkpoint(tmp_path, "loss=infcl", "loss.contrastive_weight=0.5", "model=tiny_coca",
                         "loss.caption_weight=2.0")
    (tmp_path / "last.results.csv").write_text("set,task,metric,value\nimagenet,zeroshot,top1,63.21\n")
    export_script().main([f"ckpt={ckpt}", f"out={tmp_path / 'out'}", "license=mit", "datasets=laion/laion400m"])
    card = (tmp_path / "out" / "README.md").read_text()
    meta = card.split("---")[1]
    for line in ("library_name: open_clip", "pipeline_tag: zero-shot-image-classification", "license: mit",
                 "- laion/laion400m"):
        assert line in meta, line
    for fact in ("| global batch | 4096 |", "| steps | 120 |", "| samples seen | 491520 |", "InfClLoss` (weight 0.5)",
                 "caption loss (weight 2.0)", "the embedded digits", "| imagenet | zeroshot | top1 | 63.21 |",
                 "create_model_and_transforms('hf-hub:<org>/<name>')", "local-dir:"):
        assert fact in card, fact


def test_push_without_a_token_stops_before_anything_is_written(tmp_path):
    ckpt, _ = checkpoint(tmp_path)
    env = {**__import__("os").environ, "HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), f"ckpt={ckpt}",
                             f"out={tmp_path / 'out'}", "push=my-lab/tiny"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "needs a Hugging Face token" in result.stderr and "huggingface-cli login" in \
        result.stderr
    assert not (tmp_path / "out").exists()
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), f"ckpt={ckpt}",
                          f"out={tmp_path / 'out'}", "push=tiny"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "push='tiny': give the Hub repository as <org or user>/<name>" in bad.stderr


def test_push_uploads_the_folder_with_its_card(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class Api:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create", repo_id, kwargs.get("exist_ok")))

        def upload_folder(self, folder_path, repo_id, **kwargs):
            from pathlib import Path

            calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    ckpt, _ = checkpoint(tmp_path)
    export_script().main([f"ckpt={ckpt}", f"out={tmp_path / 'out'}", "push=my-lab/tiny", "check=false"])
    assert calls[0] == ("token", "hf_test") and calls[1] == ("create", "my-lab/tiny", True)
    assert calls[2][:2] == ("upload", "my-lab/tiny")
    assert {"README.md", "open_clip_config.json", "open_clip_model.safetensors"} <= set(calls[2][2])
    assert "# my-lab/tiny" in (tmp_path / "out" / "README.md").read_text()
    assert "hf-hub:my-lab/tiny" in (tmp_path / "out" / "README.md").read_text()


def test_the_card_names_the_caption_warmup():
    from omegaconf import OmegaConf

    from megabatch.models.card import objectives

    loss = {"_target_": "megabatch.losses.SigLipLoss", "caption_weight": 1.0}
    assert objectives(OmegaConf.create({"loss": loss}))[1] == "caption loss (weight 1.0)"
    warmed = objectives(OmegaConf.create({"loss": {**loss, "caption_warmup": 0.2}}))
    assert warmed[1] == "caption loss (weight 1.0, reached after the first 20% of the steps)"
