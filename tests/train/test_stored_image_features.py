"""LiT from stored image features (``model.image_features=stored``): the locked image tower's features, written
into the shards by ``scripts/make_shards.py image-features``, stand for the tower in training. The text tower's
loss and gradients equal the locked tower's own run on the same images (one pass, GradCache's sub-batches, 2
gloo ranks); samples without usable features are skipped and counted; features of another tower, and settings
that need the images, are config errors naming the key; the writer resumes; evaluation and the checkpoint keep
the real tower."""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.cli import quote_patterns
from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.distributed.fsdp import full
from megabatch.train.build.parts import RunParts

from ..helpers import ROOT, compose, rel_error, run_ranks
from .test_distill_step import AUGMENT_OFF, script
from .test_gradcache import BASE, BATCH, flat

LOCKED = ["model.lock_image=true", "model.image.patch_dropout=0", *AUGMENT_OFF]
STORED = ["model.image_features=stored", "data.train.image_features_key=image.npy"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict:
    """The digits' training shards, and their copies with the locked tiny tower's features (float32, and the
    default float16), written as a user writes them (``--model``: the run's own model overrides)."""
    from megabatch.data.digits import ensure_digits

    pattern = ensure_digits(compose().data.cache_dir)["train"]
    folder = tmp_path_factory.mktemp("features")
    made = subprocess.run([sys.executable, "scripts/make_shards.py", "image-features", pattern, "--out",
                           str(folder / "float32"), "--model", "model.lock_image=true", "--dtype", "float32",
                           "--batch", "100"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "wrote 3 shard(s)" in made.stdout
    script().main(["image-features", pattern, "--out", str(folder / "float16"), "--model", "model.lock_image=true",
                   "--batch", "64", "--workers", "2"])
    return {"plain": pattern, **{dtype: str(folder / dtype / Path(pattern).name) for dtype in ("float32", "float16")}}


def gradients(*overrides: str, loss: str = "infcl") -> dict:
    cfg = validate(compose(*BASE, f"loss={loss}", *(["loss.tile=8"] if loss == "infcl" else []),
                           *(["model.init_logit_bias=-10"] if loss == "siglip" else []), *LOCKED,
                           *quote_patterns(list(overrides))))
    parts = RunParts.build(cfg, init_distributed("cpu"))
    stream = parts.inputs(0)
    sub = next(stream)
    loss, _ = parts.step.gradients(itertools.chain([sub], stream))
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    result = {"loss": loss.detach(), "grads": grads, "images": sub.images, "stats": sub.stats}
    parts.close()
    return result


def test_stored_features_give_the_locked_towers_loss_and_gradients(shards):
    tower = gradients()
    assert not any(name.startswith("clip.visual.") for name in tower["grads"])  # locked: the text tower trains
    stored = gradients(*STORED, f"data.train.urls={shards['float32']}")
    assert stored["images"].shape == (BATCH, 64) and stored["images"].dtype == torch.float32  # no image decoded
    assert stored["grads"].keys() == tower["grads"].keys()
    assert rel_error(stored["loss"], tower["loss"]) <= 1e-6
    assert rel_error(flat(stored["grads"]), flat(tower["grads"])) <= 1e-5
    for extra in ([f"trainer.sub_batch={BATCH // 4}"], [f"trainer.sub_batch={BATCH // 4}", "trainer.offload=true"]):
        cached = gradients(*STORED, f"data.train.urls={shards['float32']}", *extra)
        assert rel_error(cached["loss"], tower["loss"]) <= 1e-6, extra
        assert rel_error(flat(cached["grads"]), flat(tower["grads"])) <= 1e-5, extra
    half = gradients(*STORED, f"data.train.urls={shards['float16']}")
    assert half["images"].dtype == torch.float16
    assert 0 < rel_error(flat(half["grads"]), flat(tower["grads"])) <= 1e-2  # float16 features: rounded


@pytest.mark.parametrize("loss", ["siglip", "disco", "local", "vanilla"])
def test_every_loss_takes_the_stored_features(shards, loss):
    tower = gradients(loss=loss)
    for extra in ([], [f"trainer.sub_batch={BATCH // 4}"]):
        stored = gradients(*STORED, f"data.train.urls={shards['float32']}", *extra, loss=loss)
        assert rel_error(stored["loss"], tower["loss"]) <= 1e-6, extra
        assert rel_error(flat(stored["grads"]), flat(tower["grads"])) <= 1e-5, extra


def two_ranks(rank: int, world: int, urls: str) -> dict:
    result = gradients(*STORED, f"data.train.urls={urls}", "trainer.sub_batch=4")
    return {k: result[k] for k in ("loss", "grads")}


def test_two_ranks_equal_the_locked_tower_in_one_process(shards, tmp_path):
    single = gradients()
    for ranked in run_ranks(2, two_ranks, shards["float32"], tmp_path=tmp_path):
        assert rel_error(ranked["loss"], single["loss"]) <= 1e-6
        assert rel_error(flat(ranked["grads"]), flat(single["grads"])) <= 1e-5


def test_samples_without_usable_features_are_skipped_and_counted(shards, tmp_path):
    from megabatch.data.teacher_store import encode_embeddings

    from ..helpers import rewrite_members, sample_keys

    source = Path(shards["float32"]).parent
    for path in source.iterdir():
        shutil.copy(path, tmp_path / path.name)
    first = sorted(tmp_path.glob("*.tar"))[0]
    keys = sample_keys(first)
    rewrite_members(first, {f"{keys[0]}.image.npy": None,  # no features
                            f"{keys[1]}.image.npy": encode_embeddings(np.zeros(7, np.float32)),  # another width
                            f"{keys[2]}.image.npy": encode_embeddings(np.full(64, np.nan, np.float32))})  # not finite
    urls = tmp_path / Path(shards["float32"]).name
    result = gradients(*STORED, "data.train.split=position", "data.train.shuffle_buffer=1", f"data.train.urls={urls}")
    assert result["stats"]["corrupt_image"] == 3 and torch.isfinite(result["loss"])


def test_another_towers_features_and_settings_that_need_images_are_config_errors(shards):
    with pytest.raises(ConfigError, match=r"model\.image_features=stored reads .* set data\.train\.image_features_key"):
        validate(compose("model.lock_image=true", "model.image_features=stored"))
    with pytest.raises(ConfigError, match=r"data\.train\.image_features_key=image\.npy is read only with model\.image"):
        validate(compose("data.train.image_features_key=image.npy"))
    with pytest.raises(ConfigError, match=r"model\.image_features='pixels': give tower .* or stored"):
        validate(compose("model.image_features=pixels"))
    with pytest.raises(ConfigError, match=r"set model\.lock_image=true"):
        validate(compose(*STORED))
    with pytest.raises(ConfigError, match=r"loss\.caption_weight=1\.0 with model\.image_features=stored"):
        validate(compose("model=tiny_coca", "loss.caption_weight=1.0", "model.lock_image=true", *STORED))
    with pytest.raises(ConfigError, match=r"distill\.teacher=ViT-B-32 with model\.image_features=stored"):
        validate(compose("distill.teacher=ViT-B-32", "model.lock_image=true", *STORED))
    with pytest.raises(ConfigError, match=r"data\.decode=gpu with model\.image_features=stored"):
        validate(compose("data.decode=gpu", "model.lock_image=true", *STORED))
    with pytest.raises(ConfigError, match=r"image_features_key=image\.npy: .*image_features\.json does not exist"):
        RunParts.build(validate(compose(*BASE, *LOCKED, *STORED)), init_distributed("cpu"))  # the plain digits
    # another tower: other weights (the seed), another width
    for other, difference in (("seed=1", r"the weights \(fingerprint"), ("model.embed_dim=32", r"width 64 there, 32")):
        with pytest.raises(ConfigError, match=r"written by image tower 'tiny', which is not this run's .*"
                           + difference):
            RunParts.build(validate(compose(*BASE, *LOCKED, *STORED, other, *quote_patterns(
                [f"data.train.urls={shards['float32']}"]))), init_distributed("cpu"))


def test_under_torchrun_each_rank_writes_its_share(shards, tmp_path):
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "scripts/make_shards.py",
                          "image-features", shards["plain"], "--out", str(tmp_path), "--model", "model.lock_image=true",
                          "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "rank 0: wrote 2 shard(s)" in ran.stdout and "rank 1: wrote 1 shard(s)" in ran.stdout
    alone = Path(shards["float16"]).parent
    assert (tmp_path / "image_features.json").read_text() == (alone / "image_features.json").read_text()
    for shard in sorted(alone.glob("*.tar")):
        with tarfile.open(shard) as one, tarfile.open(tmp_path / shard.name) as two:
            names = [m.name for m in one.getmembers()]
            assert names == [m.name for m in two.getmembers()]
            for name in (n for n in names if n.endswith(".image.npy")):
                np.testing.assert_allclose(np.load(io.BytesIO(two.extractfile(name).read())),
                                           np.load(io.BytesIO(one.extractfile(name).read())), atol=1e-3)


def test_a_damaged_shard_is_copied_as_it_is_and_a_stream_is_refused(shards, tmp_path, capsys):
    """A shard that cannot be read to its end is copied byte for byte (the copies keep the sources' names and counts; a
    run meets its damage as the source's); a source that is not a local file is a clear error before anything."""
    plain = sorted(Path(shards["plain"]).parent.glob("train-*.tar"))
    sources = tmp_path / "sources"
    sources.mkdir()
    for path in plain:
        shutil.copy(path, sources / path.name)
    damaged = sources / plain[-1].name
    os.truncate(damaged, damaged.stat().st_size // 2)
    pattern = str(sources / "train-{000000..000002}.tar")
    script().main(["image-features", pattern, "--out", str(tmp_path / "out"), "--model", "model.lock_image=true",
                   "--workers", "1"])
    assert "wrote 3 shard(s)" in capsys.readouterr().out
    assert (tmp_path / "out" / damaged.name).read_bytes() == damaged.read_bytes()
    with tarfile.open(tmp_path / "out" / plain[0].name) as tar:
        assert any(name.endswith(".image.npy") for name in tar.getnames())
    with pytest.raises(SystemExit):
        script().main(["image-features", "pipe:cat /data/x.tar", "--out", str(tmp_path / "out2"), "--model",
                       "model.lock_image=true"])
    assert "not local files (e.g. pipe:cat /data/x.tar)" in capsys.readouterr().err


def test_the_writer_resumes_and_refuses_another_towers_folder(shards, capsys):
    folder = Path(shards["float32"]).parent
    script().main(["image-features", shards["plain"], "--out", str(folder), "--model", "model.lock_image=true",
                   "--dtype", "float32"])
    assert "wrote 0 shard(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script().main(["image-features", shards["plain"], "--out", str(folder), "--model",
                       "model.lock_image=true seed=1"])
    assert "describes another image tower's features" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script().main(["image-features", shards["plain"], "--out", str(folder)])
    assert "one of --tower or --model" in capsys.readouterr().err


def results(run: Path) -> list:
    return json.loads((run / "checkpoints" / "last.results.json").read_text())["rows"]


def test_a_run_on_stored_features_evaluates_and_checkpoints_the_real_tower(shards, tmp_path):
    """The same run on the locked tower and on its stored (float32) features: the same zero-shot results at the
    end (the evaluation encodes the images with the tower either way); the stored run's checkpoint holds the tower,
    and scripts/evaluate.py on it gives those results again."""
    ran = {}
    for name, extra in (("tower", []), ("stored", [*STORED, f"data.train.urls={shards['float32']}"])):
        ran[name] = subprocess.run([sys.executable, "train.py", f"run_dir={tmp_path / name}", "trainer.max_steps=3",
                                    "batch=32", *LOCKED, *extra], cwd=ROOT, capture_output=True, text=True,
                                   timeout=300)
        assert ran[name].returncode == 0, ran[name].stderr[-3000:]
    assert "the locked image tower tiny is not run in training" in ran["stored"].stdout + ran["stored"].stderr
    stored = results(tmp_path / "stored")
    assert stored and stored == results(tmp_path / "tower")
    checkpoint = tmp_path / "stored" / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert any(name.startswith("clip.visual.") for name in state["model"])  # the tower is kept
    (tmp_path / "stored" / "checkpoints" / "last.results.json").unlink()
    evaluated = subprocess.run([sys.executable, "scripts/evaluate.py", f"ckpt={checkpoint}"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert results(tmp_path / "stored") == stored
