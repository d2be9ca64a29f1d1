"""The dense probe (``eval.<name>.task=dense_probe``, eval/dense.py): scenes of ``mosaic x mosaic`` images, each
patch labelled with its image's class, a linear probe on the frozen tower's patch tokens. It reads where each patch
lies (a colour per class, which a random tower's patch tokens keep), which the scene's pooled feature cannot."""

from __future__ import annotations

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.eval import dense
from megabatch.eval.zeroshot import run_zeroshot
from megabatch.models import build_model

from ..helpers import compose
from .test_linear_probe import digit_folder


def test_a_scene_holds_its_images_row_by_row_and_each_patch_its_images_label():
    images = torch.arange(4, dtype=torch.float32).view(4, 1, 1, 1).expand(4, 3, 32, 32).contiguous()
    scenes, tiles = dense.mosaics(torch.cat([images, images[:3]]), torch.tensor([5, 6, 7, 8, 1, 2, 3]), 2)
    assert scenes.shape == (1, 3, 32, 32) and tiles.tolist() == [[[5, 6], [7, 8]]]  # the last 3: no whole scene
    assert scenes[0, 0, :16, :16].unique().tolist() == [0.0] and scenes[0, 0, :16, 16:].unique().tolist() == [1.0]
    assert scenes[0, 0, 16:, :16].unique().tolist() == [2.0] and scenes[0, 0, 16:, 16:].unique().tolist() == [3.0]
    assert dense.patch_labels(tiles, (4, 4)).view(4, 4).tolist() == [[5, 5, 6, 6], [5, 5, 6, 6], [7, 7, 8, 8],
                                                                     [7, 7, 8, 8]]


def colour_set(tmp_path) -> list[str]:
    root = tmp_path / "colours"
    digit_folder(root, 24, 0, "train")
    digit_folder(root, 8, 1, "test")
    (root / "classnames.txt").write_text("red\ngreen\nblue\n")
    return ["eval=digits_dense", "eval.digits_dense.format=clip_benchmark", f"eval.digits_dense.root={root}",
            "eval.digits_dense.batch_size=8", "eval.digits_dense.classnames=null"]


def test_the_dense_probe_reads_where_each_patch_lies_and_a_pooled_feature_cannot(tmp_path, monkeypatch):
    cfg = validate(compose(*colour_set(tmp_path)))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    eval_cfg, cpu = cfg.eval.digits_dense, torch.device("cpu")
    result = run_zeroshot(model, model.tokenizer(), eval_cfg, cfg.data, cpu)
    assert result["scenes"] == 6 and result["samples"] == 6 * 16  # 24 test images, 4 a scene, 4 x 4 patches each
    assert result["dense_miou"] > 90 and result["dense_top1"] > 95
    from megabatch.models import views  # eval/dense.py imports tower_tokens from here at each call

    tokens_of = views.tower_tokens

    def pooled(visual, images):  # every patch the scene's mean token: nothing of its place
        output, tokens = tokens_of(visual, images)
        return output, tokens.mean(dim=1, keepdim=True).expand_as(tokens)

    monkeypatch.setattr(views, "tower_tokens", pooled)
    blind = run_zeroshot(model, model.tokenizer(), eval_cfg, cfg.data, cpu)
    assert blind["dense_miou"] < 50 < result["dense_miou"] - 40


def test_bad_dense_probe_settings_are_config_errors(tmp_path):
    overrides = colour_set(tmp_path)
    with pytest.raises(ConfigError, match="eval.digits_dense.mosaic"):
        validate(compose(*overrides, "eval.digits_dense.mosaic=0"))
    with pytest.raises(ConfigError, match="eval.digits_dense.fewshot=5: the dense probe"):
        validate(compose(*overrides, "eval.digits_dense.fewshot=5"))
    cfg = validate(compose(*overrides, "eval.digits_dense.mosaic=3"))  # the tiny tower's 4 x 4 patches
    model = build_model(cfg.model).eval()
    with pytest.raises(ConfigError, match=r"eval.digits_dense.mosaic=3: the tower's 4 x 4 patches"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.digits_dense, cfg.data, torch.device("cpu"))
    cfg = validate(compose(*overrides, "model=tiny_naflex"))
    model = build_model(cfg.model).eval()
    with pytest.raises(ConfigError, match="eval.digits_dense.task=dense_probe reads an open_clip ViT"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.digits_dense, cfg.data, torch.device("cpu"))
