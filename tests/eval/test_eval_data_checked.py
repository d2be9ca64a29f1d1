"""Every evaluation set's data is checked before anything is built (issue 81): an ImageFolder, a linear probe's
split folders, ObjectNet's folder, a JSONL, local shards and a CLIP_benchmark folder that are not there are a
config error naming the key and the fix, from ``validate`` (training) and from ``scripts/evaluate.py``; a
training run with a missing ImageFolder writes no checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megabatch.config import ConfigError
from megabatch.config.schema import validate

from ..helpers import ROOT, compose


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(compose(*overrides))
    return str(caught.value)


def test_an_imagefolder_that_is_missing_or_has_no_class_folders(tmp_path):
    message = refused("eval=imagenet", f"eval.imagenet.root={tmp_path / 'val'}")
    assert message.startswith(f"eval.imagenet.root='{tmp_path / 'val'}': not a readable folder")
    assert "eval=none" in message
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "README").write_text("no classes here")
    assert "no class folders" in refused("eval=imagenet", f"eval.imagenet.root={tmp_path / 'val'}")
    (tmp_path / "val" / "n01440764").mkdir()
    validate(compose("eval=imagenet", f"eval.imagenet.root={tmp_path / 'val'}"))


def test_a_linear_probes_split_folders(tmp_path):
    (tmp_path / "test" / "a").mkdir(parents=True)
    overrides = ["eval=digits_probe", "eval.digits_probe.format=folder", f"eval.digits_probe.root={tmp_path}",
                 "eval.digits_probe.split=test"]
    assert f"{tmp_path / 'train'} is not a readable ImageFolder" in refused(*overrides)
    (tmp_path / "train" / "a").mkdir(parents=True)
    validate(compose(*overrides))


def test_objectnet_jsonl_shards_and_clip_benchmark(tmp_path):
    assert "not a readable folder (the ObjectNet release folder)" in refused(
        "eval=objectnet", f"eval.objectnet.root={tmp_path / 'objectnet'}")
    assert "eval.retrieval.jsonl=" in refused("eval=retrieval", f"eval.retrieval.jsonl={tmp_path / 'pairs.jsonl'}")
    assert "matches no file" in refused("eval=imagenet", "eval.imagenet.format=wds", "eval.imagenet.root=null",
                                        f"eval.imagenet.urls='{tmp_path}/val-{{000..009}}.tar'")
    assert "is not a folder (a CLIP_benchmark dataset" in refused(
        "eval=imagenet", "eval.imagenet.format=clip_benchmark", f"eval.imagenet.root={tmp_path / 'cb'}")
    validate(compose("eval=imagenet", "eval.imagenet.format=wds", "eval.imagenet.root=null",
                     "eval.imagenet.urls='pipe:cat /data/val.tar'"))  # a stream is read when the set is


def test_a_missing_imagefolder_stops_training_before_it_starts_and_evaluate_too(tmp_path):
    missing = tmp_path / "imagenet" / "val"
    train = subprocess.run([sys.executable, str(ROOT / "train.py"), "eval=imagenet", f"eval.imagenet.root={missing}",
                            "trainer.max_steps=5", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 2 and train.stderr.strip().startswith("config error: eval.imagenet.root=")
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained
    evaluate = subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), f"ckpt={tmp_path / 'x.pt'}",
                               "eval=imagenet", f"eval.imagenet.root={missing}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    assert evaluate.returncode == 2 and "eval.imagenet.root=" in evaluate.stderr and "not a readable" in evaluate.stderr
