"""Linear and few-shot probes (``task=linear_probe``, eval/probe.py) and multi-label sets (mAP): the weight-decay
search finds the validation optimum of CLIP_benchmark's grid, the probe recovers a planted linear signal (and not
one that is absent), few-shot takes k images a class, features are kept on disk and read back by a second probe,
and a multi-label set's mAP equals CLIP_benchmark's own evaluator on the same folder."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.data.transforms import eval_transform
from megabatch.eval import probe as probe_module
from megabatch.eval.probe import WEIGHT_DECAYS, fewshot_indices, probe, search_weight_decay
from megabatch.eval.zeroshot import average_precision, run_zeroshot
from megabatch.models import build_model

from ..helpers import compose
from .test_clip_benchmark_format import image, numpy2_accuracy, write_set


@pytest.mark.parametrize("peak", [0, 5, 37, 48, 71, 96])
def test_the_search_finds_the_validation_optimum_of_the_grid(peak):
    calls = []

    def score(weight_decay: float) -> float:  # validation top-1, best at grid index `peak`, lower either side
        index = WEIGHT_DECAYS.index(weight_decay)
        calls.append(index)
        return 90.0 - abs(index - peak) / 4

    found, scores = search_weight_decay(score)
    assert found == peak and WEIGHT_DECAYS[found] == pytest.approx(10 ** (-6 + peak / 12))
    assert scores[found] == max(scores.values())
    assert len(calls) == len(set(calls)) <= 7 + 2 * 4  # each weight decay trained once
    assert len(WEIGHT_DECAYS) == 97 and WEIGHT_DECAYS[0] == pytest.approx(1e-6) and WEIGHT_DECAYS[-1] == 100


def planted(n: int, seed: int, shuffled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(6, 16, generator=torch.Generator().manual_seed(99))  # the same planted map for every split
    features = torch.nn.functional.normalize(torch.randn(n, 16, generator=generator), dim=-1)
    labels = (features @ signal.T).argmax(dim=1)
    if shuffled:
        labels = labels[torch.randperm(n, generator=generator)]
    return features, labels


def probe_cfg(**overrides):
    keys = {"name": "planted", "fewshot": None, "probe_lr": 0.1, "probe_epochs": 10, "probe_batch_size": 64,
            "probe_seed": 0, **overrides}
    return OmegaConf.create(keys)


def test_the_probe_recovers_a_planted_linear_signal_and_not_an_absent_one():
    splits = {"train": planted(600, 1), "val": planted(150, 2), "test": planted(300, 3)}
    result = probe(splits, probe_cfg(), torch.device("cpu"))
    assert result["lp_top1"] > 85 and result["lp_top5"] > 99 and result["lp_mean_per_class_recall"] > 80
    assert result["weight_decay"] in WEIGHT_DECAYS and result["weight_decays_tried"] <= 15
    assert result["train_samples"] == 750  # the final classifier: train + validation
    noise = {"train": planted(600, 1, True), "val": planted(150, 2, True), "test": planted(300, 3, True)}
    assert probe(noise, probe_cfg(), torch.device("cpu"))["lp_top1"] < 45  # chance is ~1/6 of the classes


def test_few_shot_takes_k_images_a_class_and_refuses_more_than_there_are():
    labels = torch.cat([torch.arange(30) % 3, torch.zeros(4, dtype=torch.long)])
    rows = fewshot_indices(labels, 3, 0, "eval.x")
    assert torch.bincount(labels[rows]).tolist() == [3, 3, 3]
    assert not torch.equal(rows, fewshot_indices(labels, 3, 1, "eval.x"))  # another seed, other shots
    with pytest.raises(ConfigError, match=r"eval\.x\.fewshot=11: class 1 has 10 training images"):
        fewshot_indices(labels, 11, 0, "eval.x")
    splits = {"train": planted(600, 1), "val": planted(150, 2), "test": planted(300, 3)}
    result = probe(splits, probe_cfg(fewshot=5), torch.device("cpu"))
    assert result["train_samples"] == 30 and result["fewshot_k"] == 5  # few-shot: the k shots alone, no val


def digit_folder(root, per_class: int, seed: int, split: str):
    """Images whose colour tells the class (a linear signal a random tower keeps), CLIP_benchmark's layout."""
    rng = np.random.default_rng(seed)
    samples = []
    for index in range(per_class * 3):
        label = index % 3
        pixels = rng.integers(0, 60, (24, 24, 3)).astype(np.uint8)
        pixels[..., label] += 180
        from megabatch.data.shard_writer import encode_png

        samples.append({"png": encode_png(pixels), "cls": label})
    write_set(root, samples, per_shard=8, split=split)


def test_a_linear_probe_on_a_clip_benchmark_folder_keeps_its_features(tmp_path, monkeypatch):
    root = tmp_path / "set"
    digit_folder(root, 12, 0, "train")
    digit_folder(root, 6, 1, "test")
    (root / "classnames.txt").write_text("red\ngreen\nblue\n")
    cfg = validate(compose("eval=digits_probe", "eval.digits_probe.format=clip_benchmark",
                           f"eval.digits_probe.root={root}", "eval.digits_probe.batch_size=8"))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    encoded = []
    original = model.encode_image
    monkeypatch.setattr(model, "encode_image", lambda images: encoded.append(len(images)) or original(images))
    cache = str(tmp_path / "last.features" / "raw")
    first = run_zeroshot(model, model.tokenizer(), cfg.eval.digits_probe, cfg.data, torch.device("cpu"), cache=cache)
    assert sum(encoded) == 36 + 18 and first["features_cached"] == 0 and first["samples"] == 18
    assert first["train_samples"] == 36 and first["lp_top1"] > 80  # the colour is read from the frozen features
    encoded.clear()
    again = run_zeroshot(model, model.tokenizer(), cfg.eval.digits_probe, cfg.data, torch.device("cpu"), cache=cache)
    assert encoded == [] and again == {**first, "features_cached": 1.0}
    few = cfg.eval.digits_probe.copy()
    few.fewshot = 2
    assert run_zeroshot(model, model.tokenizer(), few, cfg.data, torch.device("cpu"), cache=cache)["train_samples"] == 6
    assert encoded == []  # another probe of the same features: read, not encoded
    moved = tmp_path / "moved"
    root.rename(moved)
    other = cfg.eval.digits_probe.copy()
    other.root = str(moved)
    run_zeroshot(model, model.tokenizer(), other, cfg.data, torch.device("cpu"), cache=cache)
    assert sum(encoded) == 54  # other data than the kept features': encoded again


def test_a_probe_without_its_training_split_or_with_bad_keys_is_a_config_error(tmp_path):
    digit_folder(tmp_path, 2, 1, "test")
    (tmp_path / "classnames.txt").write_text("red\ngreen\nblue\n")
    cfg = validate(compose("eval=digits_probe", "eval.digits_probe.format=clip_benchmark",
                           f"eval.digits_probe.root={tmp_path}"))
    model = build_model(cfg.model)
    with pytest.raises(ConfigError, match=r"eval\.digits_probe\.root=.* has no train/nshards\.txt"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.digits_probe, cfg.data, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"eval\.digits_probe\.val_proportion=1\.5"):
        validate(compose("eval=digits_probe", "eval.digits_probe.val_proportion=1.5"))
    with pytest.raises(ConfigError, match=r"eval\.digits_probe\.fewshot=0 must be at least 1"):
        validate(compose("eval=digits_probe", "eval.digits_probe.fewshot=0"))
    with pytest.raises(ConfigError, match=r"eval\.probe\.task=linear_probe needs eval\.probe\.train_urls"):
        validate(compose("eval=digits_probe", "eval.digits_probe.name=probe", "eval.digits_probe.classnames=[a,b]"))


def test_average_precision_by_hand():
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.7], [0.3, 0.2], [0.1, 0.9]])
    targets = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 0]])
    # class 0 ranked: 0.9 (hit), 0.8, 0.3 (hit), 0.1 -> (1/1 + 2/3) / 2; class 1: 0.9, 0.7 (hit) -> 1/2
    assert average_precision(scores, targets).tolist() == pytest.approx([(1 + 2 / 3) / 2, 0.5])


def test_a_multilabel_sets_map_equals_clip_benchmarks_evaluator(tmp_path, monkeypatch):
    builder = pytest.importorskip("clip_benchmark.datasets.builder")
    classification = pytest.importorskip("clip_benchmark.metrics.zeroshot_classification")
    rng = np.random.default_rng(0)

    def npy(vector) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(vector, dtype=np.int64))
        return buffer.getvalue()

    labels = [(rng.random(4) < 0.4).astype(int) for _ in range(13)]
    write_set(tmp_path, [{"png": image(30 + i), "npy": npy(v)} for i, v in enumerate(labels)],
              classnames="cat\ndog\nperson\ncar\n", zeroshot_classification_templates="a photo of a {c}\n",
              dataset_type="multilabel\n")
    cfg = validate(compose("eval=imagenet", "eval.imagenet.format=clip_benchmark", f"eval.imagenet.root={tmp_path}",
                           "eval.imagenet.classnames=null", "eval.imagenet.templates=null",
                           "eval.imagenet.batch_size=4"))
    monkeypatch.setattr(classification, "accuracy", numpy2_accuracy)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    ours = run_zeroshot(model, model.tokenizer(), cfg.eval.imagenet, cfg.data, torch.device("cpu"))
    dataset = builder.build_wds_dataset("wds/voc", eval_transform(model.preprocess), data_dir=str(tmp_path))
    theirs = classification.evaluate(model, DataLoader(dataset, batch_size=4), model.tokenizer(), dataset.classes,
                                     dataset.templates, "cpu", amp=False)
    assert ours["samples"] == 13 and set(ours) == {"mAP", "samples"}
    assert ours["mAP"] == pytest.approx(100 * theirs["mean_average_precision"], abs=1e-4)
    assert 0 < ours["mAP"] < 100
    probe_cfg_ = cfg.eval.imagenet.copy()
    probe_cfg_.task = "linear_probe"
    with pytest.raises(ConfigError, match=r"is a multilabel set: the linear probe takes one class"):
        run_zeroshot(model, model.tokenizer(), probe_cfg_, cfg.data, torch.device("cpu"))


def test_probe_module_documents_its_defaults():
    from megabatch.config.schema import EvalConfig

    defaults = EvalConfig()
    assert (defaults.probe_lr, defaults.probe_epochs, defaults.probe_batch_size, defaults.val_proportion) == \
        (0.1, 10, 64, 0.2)  # CLIP_benchmark's --fewshot_lr, --fewshot_epochs, --batch_size
    assert "logspace(-6, 2, 97)" in probe_module.__doc__
