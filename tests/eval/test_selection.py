"""Image-caption selection (``task=image_caption_selection``: SugarCrepe, Winoground): the accuracies equal
CLIP_benchmark's own ``image_caption_selection`` evaluator on the same instances, per subset too; bad rows and a
missing file are config errors naming the key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.data.shard_writer import encode_png
from megabatch.data.transforms import eval_transform
from megabatch.eval.zeroshot import run_zeroshot
from megabatch.models import build_model

from ..helpers import compose

selection = pytest.importorskip("clip_benchmark.metrics.image_caption_selection")


def instances(tmp_path) -> list[dict]:
    rows = []
    for index in range(9):  # SugarCrepe-like: one image, its caption and a hard negative, in three subsets
        (tmp_path / f"{index}.png").write_bytes(
            encode_png(np.random.default_rng(index).integers(0, 255, (24, 24, 3), dtype=np.uint8)))
        rows.append({"image": f"{index}.png", "captions": [f"a photo of the digit {index}", f"the number {9 - index}"],
                     "subset": ["replace_obj", "swap_att", "add_rel"][index % 3]})
    for index in range(3):  # Winoground-like: two images, two captions
        rows.append({"images": [f"{index}.png", f"{index + 3}.png"],
                     "captions": [f"a scan of a {index}", f"a scan of a {index + 3}"], "subset": "winoground"})
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


@pytest.mark.parametrize("workers", [0, 2])
def test_accuracies_equal_clip_benchmarks_evaluator_per_subset(tmp_path, workers):
    """Images opened in the main process, and by 2 loader workers."""
    from PIL import Image

    rows = instances(tmp_path)
    cfg = validate(compose("eval=sugarcrepe", f"eval.sugarcrepe.jsonl={tmp_path / 'set.jsonl'}",
                           "eval.sugarcrepe.batch_size=5", f"eval.sugarcrepe.num_workers={workers}"))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    ours = run_zeroshot(model, model.tokenizer(), cfg.eval.sugarcrepe, cfg.data, torch.device("cpu"))
    transform = eval_transform(model.preprocess)

    def theirs(subset=None):  # CLIP_benchmark's batches: [1, images, 3, s, s] and the instance's captions
        batches = [(torch.stack([transform(Image.open(tmp_path / p).convert("RGB"))
                                 for p in row.get("images") or [row["image"]]])[None], [row["captions"]])
                   for row in rows if subset in (None, row["subset"])]
        return {k: 100 * v for k, v in selection.evaluate(model, batches, model.tokenizer(), "cpu", amp=False).items()}

    assert ours["samples"] == len(rows)
    for suffix, subset in [("", None)] + [(f"/{s}", s) for s in ("replace_obj", "swap_att", "add_rel", "winoground")]:
        reference = theirs(subset)
        for metric in ("text_acc", "image_acc", "acc"):
            assert ours[metric + suffix] == pytest.approx(reference[metric], abs=1e-4), metric + suffix
    assert 0 < ours["acc"] < 100  # neither all right nor all wrong: the comparison means something


def test_bad_rows_and_missing_files_name_the_key(tmp_path):
    cfg = compose("eval=sugarcrepe", f"eval.sugarcrepe.jsonl={tmp_path / 'set.jsonl'}")
    model = build_model(cfg.model)
    (tmp_path / "set.jsonl").write_text(json.dumps({"image": "a.png", "captions": ["only one"]}) + "\n")
    with pytest.raises(ConfigError, match=r"eval\.sugarcrepe\.jsonl=.* line 1: give an image .* at least two captions"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.sugarcrepe, cfg.data, torch.device("cpu"))
    (tmp_path / "set.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"eval\.sugarcrepe\.jsonl=.* does not exist"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.sugarcrepe, cfg.data, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"eval=sugarcrepe needs eval\.sugarcrepe\.jsonl"):
        validate(compose("eval=sugarcrepe"))
