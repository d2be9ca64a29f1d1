"""Zero-shot evaluation from an ImageFolder with real class names, and retrieval metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megabatch.data.shard_writer import encode_png
from megabatch.eval.datasets import eval_batches, templates
from megabatch.eval.zeroshot import build_classifier, evaluate_zeroshot
from megabatch.models import build_model

from ..helpers import compose


def image_folder(root, names, per_class=3, numeric=False):
    rng = np.random.default_rng(0)
    for index, name in enumerate(names):
        folder = root / (str(index) if numeric else name)
        folder.mkdir(parents=True)
        for k in range(per_class):
            pixels = np.full((20, 20, 3), 20 * index, dtype=np.uint8) + rng.integers(0, 5, (20, 20, 3), dtype=np.uint8)
            (folder / f"{k}.png").write_bytes(encode_png(pixels))
    return root


@pytest.mark.parametrize("numeric", [False, True])
def test_imagefolder_labels_follow_the_class_order(tmp_path, numeric):
    from megabatch.data.transforms import eval_transform
    from megabatch.models.preprocess import resolve_preprocess

    # 12 numeric folders: as text "10" < "2", by number 2 < 10 (ImageNet-V2's layout)
    names = [f"n{index:08d}" for index in range(12)]
    root = image_folder(tmp_path / "val", names, per_class=1, numeric=numeric)
    cfg = compose("eval=imagenet", f"eval.imagenet.root={root}", "eval.imagenet.num_workers=0",
                  f"eval.imagenet.classnames=[{','.join(names)}]", "eval.imagenet.batch_size=64")
    transform = eval_transform(resolve_preprocess({}, {}, 16, "model.preprocess"))
    images, (labels, indices) = next(eval_batches(cfg.eval.imagenet, cfg.data, transform, len(names)))
    assert indices.tolist() == list(range(12))
    assert sorted(labels.tolist()) == list(range(12))
    # the folder of class k holds images of brightness 20 k: labels must follow brightness
    brightness = images.mean(dim=(1, 2, 3))[labels.argsort()]
    assert torch.all(brightness[1:] > brightness[:-1])


def test_class_count_mismatch_is_a_clear_error(tmp_path):
    from megabatch.config import ConfigError

    root = image_folder(tmp_path / "val", ["tench", "goldfish"])
    cfg = compose("eval=imagenet", f"eval.imagenet.root={root}")  # 1000 ImageNet names, 2 folders
    with pytest.raises(ConfigError, match="2 class folders"):
        eval_batches(cfg.eval.imagenet, cfg.data, None, 1000)


def test_zero_shot_on_real_imagenet_names_end_to_end(tmp_path):
    """A tiny model, ImageNet's real first three class names and the 80 OpenAI prompts."""

    from megabatch.data.transforms import eval_transform

    names = ["tench", "goldfish", "great white shark"]
    root = image_folder(tmp_path / "val", ["n01440764", "n01443537", "n01484850"])
    cfg = compose("eval=imagenet", f"eval.imagenet.root={root}", "eval.imagenet.num_workers=0",
                  f"eval.imagenet.classnames=[{','.join(repr(n) for n in names)}]")
    assert len(templates(cfg.eval.imagenet)) == 80
    model = build_model(cfg.model).eval()
    tokenize = model.tokenizer()
    classifier = build_classifier(model, tokenize, names, templates(cfg.eval.imagenet), torch.device("cpu"))
    assert classifier.shape == (cfg.model.embed_dim, 3)
    torch.testing.assert_close(classifier.norm(dim=0), torch.ones(3))
    result = evaluate_zeroshot(model, eval_batches(cfg.eval.imagenet, cfg.data, eval_transform(model.preprocess), 3),
                               classifier, torch.device("cpu"))
    assert result["samples"] == 9 and result["top5"] == 100.0  # 3 classes: top-5 is everything


def test_a_subset_of_imagenet_classes_uses_the_matching_names(tmp_path):
    from megabatch.eval.datasets import classnames

    wnids = [f"n{index:08d}" for index in range(1000)]
    (tmp_path / "wnids.txt").write_text("\n".join(wnids))
    root = image_folder(tmp_path / "imagenet_r", [wnids[1], wnids[2], wnids[999]], per_class=1)
    cfg = compose("eval=imagenet_r", f"eval.imagenet_r.root={root}",
                  f"eval.imagenet_r.subset_wnids_from={tmp_path / 'wnids.txt'}")
    assert classnames(cfg.eval.imagenet_r) == ["goldfish", "great white shark", "toilet paper"]


def test_objectnet_keeps_the_imagenet_classes_and_crops_the_border(tmp_path):
    """A miniature ObjectNet release: 3 class folders, 2 of which map to ImageNet; labels follow
    the sorted ObjectNet labels and the 1-pixel red border is gone before the transform."""
    import json

    from megabatch.eval.datasets import classnames

    root = tmp_path / "objectnet-1.0"
    (root / "mappings").mkdir(parents=True)
    folders = {"alarm_clock": "Alarm clock", "air_freshener": "Air freshener", "banana": "Banana"}
    (root / "mappings" / "folder_to_objectnet_label.json").write_text(json.dumps(folders))
    (root / "mappings" / "objectnet_to_imagenet_1k.json").write_text(
        json.dumps({"Alarm clock": "analog clock; digital clock", "Banana": "banana"}))
    for index, folder in enumerate(folders):
        (root / "images" / folder).mkdir(parents=True)
        pixels = np.full((12, 12, 3), 40 * (index + 1), dtype=np.uint8)
        pixels[0, :], pixels[-1, :], pixels[:, 0], pixels[:, -1] = [255, 0, 0], [255, 0, 0], [255, 0, 0], [255, 0, 0]
        (root / "images" / folder / "0.png").write_bytes(encode_png(pixels))
    cfg = compose("eval=objectnet", f"eval.objectnet.root={root}", "eval.objectnet.num_workers=0")
    assert classnames(cfg.eval.objectnet) == ["Alarm clock", "Banana"]
    sizes = []
    batches = eval_batches(cfg.eval.objectnet, cfg.data, lambda image: sizes.append(image.size) or
                           torch.tensor(np.asarray(image)).permute(2, 0, 1), 2)
    images, (labels, indices) = next(batches)
    assert labels.tolist() == [0, 1] and indices.tolist() == [0, 1] and sizes == [(10, 10), (10, 10)]
    assert (images[:, 0] == images[:, 1]).all()  # uniform grey: no red border left
    assert images[0, 0, 0, 0] == 40 and images[1, 0, 0, 0] == 120  # alarm_clock, then banana


def test_objectnet_root_without_mappings_is_a_clear_error(tmp_path):
    from megabatch.config import ConfigError
    from megabatch.eval.datasets import classnames

    cfg = compose("eval=objectnet", f"eval.objectnet.root={tmp_path}")
    with pytest.raises(ConfigError, match="not an ObjectNet release folder"):
        classnames(cfg.eval.objectnet)
