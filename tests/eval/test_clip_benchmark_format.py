"""``eval.<name>.format=clip_benchmark``: CLIP_benchmark's webdataset layout (test/nshards.txt, test/<i>.tar,
classnames.txt, zeroshot_classification_templates.txt, dataset_type.txt), written here, read as it is; the zero-shot
numbers (top-1, top-5, mean per-class recall) and the retrieval recalls (several captions an image) equal
CLIP_benchmark's own evaluator reading the same folder with its own loader; a folder without a file it needs is a
config error naming the key and the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.data.shard_writer import encode_png
from megabatch.data.transforms import eval_transform
from megabatch.eval.clip_benchmark import write_folder
from megabatch.eval.zeroshot import run_zeroshot
from megabatch.models import build_model

from ..helpers import compose

builder = pytest.importorskip("clip_benchmark.datasets.builder")
classification = pytest.importorskip("clip_benchmark.metrics.zeroshot_classification")
retrieval = pytest.importorskip("clip_benchmark.metrics.zeroshot_retrieval")


def write_set(root, samples: list[dict], per_shard: int = 5, split: str = "test", **files: str):
    """CLIP_benchmark's layout: ``samples`` (``{"png": bytes, "cls" or "txt" or "npy": ...}``) in shards of
    ``per_shard`` under ``split``."""
    write_folder(root, split, samples, per_shard, **files)


def image(seed: int) -> bytes:
    return encode_png(np.random.default_rng(seed).integers(0, 255, (24, 24, 3), dtype=np.uint8))


def numpy2_accuracy(output, target, topk=(1,)):
    """clip_benchmark 1.6.2's ``accuracy`` as it is, but for ``float()`` of a one-element array, which numpy 2.x
    refuses (``.item()`` instead)."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


def test_classification_equals_clip_benchmarks_evaluator(tmp_path, monkeypatch):
    labels = [0, 1, 2, 2, 1, 0, 0, 2, 1, 1, 2, 0, 1, 3, 4, 5, 5, 3, 4, 2, 0]
    write_set(tmp_path, [{"png": image(i), "cls": label} for i, label in enumerate(labels)],
              classnames="zero\none\ntwo\nthree\nfour\nfive\n",
              zeroshot_classification_templates="a photo of the digit {c}\nthe number {c}\n")
    cfg = validate(compose("eval=imagenet", "eval.imagenet.format=clip_benchmark", f"eval.imagenet.root={tmp_path}",
                           "eval.imagenet.classnames=null", "eval.imagenet.templates=null",
                           "eval.imagenet.batch_size=4"))
    monkeypatch.setattr(classification, "accuracy", numpy2_accuracy)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    ours = run_zeroshot(model, model.tokenizer(), cfg.eval.imagenet, cfg.data, torch.device("cpu"))
    dataset = builder.build_wds_dataset("wds/digits", eval_transform(model.preprocess), data_dir=str(tmp_path))
    theirs = classification.evaluate(model, DataLoader(dataset, batch_size=4), model.tokenizer(), dataset.classes,
                                     dataset.templates, "cpu", amp=False)
    assert ours["samples"] == len(labels)
    for mine, their in (("top1", "acc1"), ("top5", "acc5"), ("mean_per_class_recall", "mean_per_class_recall")):
        assert ours[mine] == pytest.approx(100 * theirs[their], abs=1e-9), mine
    assert 0 < ours["mean_per_class_recall"] < 100 and ours["top1"] != ours["mean_per_class_recall"]  # not vacuous


def test_retrieval_with_several_captions_equals_clip_benchmarks_evaluator(tmp_path):
    captions = [[f"picture {i}", f"image of {i}", f"photo {i}"][: 1 + i % 3] for i in range(7)]
    write_set(tmp_path, [{"png": image(10 + i), "txt": "\n".join(texts)} for i, texts in enumerate(captions)],
              dataset_type="retrieval\n")
    cfg = validate(compose("eval=retrieval", "eval.retrieval.format=clip_benchmark", f"eval.retrieval.root={tmp_path}",
                           "eval.retrieval.batch_size=3"))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    ours = run_zeroshot(model, model.tokenizer(), cfg.eval.retrieval, cfg.data, torch.device("cpu"))
    dataset = builder.build_wds_dataset("wds/pairs", eval_transform(model.preprocess), data_dir=str(tmp_path))
    loader = DataLoader(dataset, batch_size=3, collate_fn=builder.image_captions_collate_fn)
    theirs = retrieval.evaluate(model, loader, model.tokenizer(), "cpu", amp=False, recall_k_list=[1, 5])
    assert ours["samples"] == 7  # theirs are float32 means: equal to 1e-6 of a fraction
    for k in (1, 5):
        assert ours[f"image_to_text_R@{k}"] == pytest.approx(100 * theirs[f"text_retrieval_recall@{k}"], abs=1e-4)
        assert ours[f"text_to_image_R@{k}"] == pytest.approx(100 * theirs[f"image_retrieval_recall@{k}"], abs=1e-4)


def test_a_folder_without_a_file_it_needs_names_the_key_and_the_file(tmp_path):
    write_set(tmp_path, [{"png": image(0), "cls": 0}], classnames="zero\n")
    cfg = compose("eval=imagenet", "eval.imagenet.format=clip_benchmark", f"eval.imagenet.root={tmp_path}",
                  "eval.imagenet.classnames=null", "eval.imagenet.templates=null")
    model = build_model(cfg.model)
    with pytest.raises(ConfigError, match=r"eval\.imagenet\.root=.* has no zeroshot_classification_templates\.txt"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.imagenet, cfg.data, torch.device("cpu"))
    (tmp_path / "test" / "nshards.txt").write_text("3\n")
    (tmp_path / "zeroshot_classification_templates.txt").write_text("a {c}\n")
    with pytest.raises(ConfigError, match=r"nshards\.txt says 3 shards but .*1\.tar is missing"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.imagenet, cfg.data, torch.device("cpu"))
    (tmp_path / "dataset_type.txt").write_text("retrieval\n")
    with pytest.raises(ConfigError, match=r"is a retrieval set .*eval\.imagenet\.task=retrieval"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.imagenet, cfg.data, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"eval\.imagenet\.root is not set.*CLIP_benchmark"):
        validate(compose("eval=imagenet", "eval.imagenet.format=clip_benchmark"))


def test_evaluation_inputs_that_would_give_a_wrong_number_are_errors(tmp_path):
    """Issue 86: a 10-class folder evaluated with ImageNet's 1,000 names reported 0.00% top-1 without a word. A
    class list of another length than the folder's classnames.txt, a label outside the names in use, a template
    without a place for the name and an empty split are config errors naming the key and the fix, before any
    image is encoded."""
    from megabatch.eval import zeroshot

    write_set(tmp_path, [{"png": image(i), "cls": i % 10} for i in range(20)],
              classnames="\n".join(f"class {i}" for i in range(10)) + "\n",
              zeroshot_classification_templates="a photo of a {c}.\n")
    model = build_model(compose().model)
    encoded = []
    original = model.encode_image
    model.encode_image = lambda images: encoded.append(len(images)) or original(images)

    def evaluate(*overrides: str):
        cfg = compose("eval=imagenet", "eval.imagenet.format=clip_benchmark", f"eval.imagenet.root={tmp_path}",
                      *overrides)
        return run_zeroshot(model, model.tokenizer(), cfg.eval.imagenet, cfg.data, torch.device("cpu"))

    with pytest.raises(ConfigError, match=r"eval\.imagenet\.classnames='imagenet' gives 1000 class names but the "
                                          r"folder's classnames.txt has 10.*eval\.imagenet\.classnames=null"):
        evaluate("eval.imagenet.templates=null")
    with pytest.raises(ConfigError, match=r"eval\.imagenet: a sample's label [5-9] is outside the 5 class names"):
        (tmp_path / "classnames.txt").unlink()  # no class list in the folder: the labels are checked as they come
        evaluate("eval.imagenet.templates=null", "eval.imagenet.classnames=[a,b,c,d,e]")
    with pytest.raises(ConfigError, match=r"eval\.imagenet\.templates: 'a photo' has no \{\}"):
        evaluate("eval.imagenet.templates=[a photo]", "eval.imagenet.classnames=[a,b,c,d,e,f,g,h,i,j]")
    assert encoded == []  # nothing encoded before any of these errors
    result = evaluate("eval.imagenet.templates=null", "eval.imagenet.classnames=[a,b,c,d,e,f,g,h,i,j]")
    assert result["samples"] == 20 and encoded  # the same set with its own 10 names runs
    write_set(tmp_path / "empty", [], split="test")
    (tmp_path / "empty" / "classnames.txt").write_text("x\ny\n")
    (tmp_path / "empty" / "zeroshot_classification_templates.txt").write_text("a {c}\n")
    with pytest.raises(ConfigError, match=r"eval\.imagenet: its split holds no labelled image"):
        cfg = compose("eval=imagenet", "eval.imagenet.format=clip_benchmark",
                      f"eval.imagenet.root={tmp_path / 'empty'}", "eval.imagenet.classnames=null",
                      "eval.imagenet.templates=null")
        zeroshot.run_zeroshot(model, model.tokenizer(), cfg.eval.imagenet, cfg.data, torch.device("cpu"))
