"""Hard negatives through the trainer's step (data.train.negatives_key): read from the shards, encoded by
the text tower, GradCache's sub-batches (each negative chunk replayed with its RNG state) and 2 gloo ranks
give the one-pass step's gradients; the negatives change them; the sigmoid loss refuses them. (Reading
them, a sample without any skipped and counted: tests/data/test_captions.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.data.shard_writer import Sample, encode_png, write_shards
from megabatch.distributed import init_distributed
from megabatch.distributed.fsdp import full
from megabatch.train.build.parts import RunParts

from ..helpers import compose, rel_error, run_ranks
from .test_gradcache import BASE, flat

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> str:
    """80 captioned images, each with 2 hard negatives (other digits' captions; cycled to 3), but
    sample 9, which has none (skipped)."""
    folder, rng, samples = tmp_path_factory.mktemp("negatives"), np.random.default_rng(0), []
    for i in range(80):
        negatives = [f"a photo of {WORDS[(i + 1) % 10]}", f"the digit {WORDS[(i + 3) % 10]}"]
        meta = {} if i == 9 else {"negatives": negatives}
        samples.append(Sample(encode_png(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)), "png",
                              f"a photo of {WORDS[i % 10]}", meta))
    write_shards(samples, folder, "n", per_shard=20)
    return str(folder / "n-{000000..000003}.tar")


def gradients(rank: int, world: int, urls: str, overrides: list[str]) -> dict:
    cfg = compose(*BASE, "data=webdataset", "data.num_workers=0", "data.train.split=position",
                  "data.train.negatives_key=json:negatives", "data.train.negatives=3", *overrides)
    cfg.data.train.urls, cfg.data.cache_dir = urls, compose().data.cache_dir
    parts = RunParts.build(validate(cfg), init_distributed("cpu"))
    stream = parts.inputs(0)
    loss, _ = parts.step.gradients(stream)
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads}


@pytest.mark.parametrize("loss", ["infcl", "local"])
def test_gradcache_with_negatives_gives_the_one_pass_gradients(urls, loss):
    extra = [f"loss={loss}"] + (["loss.tile=8"] if loss == "infcl" else [])
    one_pass = gradients(0, 1, urls, extra)
    cached = gradients(0, 1, urls, extra + ["trainer.sub_batch=8"])  # 4 sub-batches, 12 negative chunks
    assert torch.equal(cached["loss"], one_pass["loss"]) or rel_error(cached["loss"], one_pass["loss"]) <= 1e-6
    assert rel_error(flat(cached["grads"]), flat(one_pass["grads"])) <= 1e-5
    assert rel_error(cached["grads"]["clip.logit_scale"], one_pass["grads"]["clip.logit_scale"]) <= 1e-5
    plain = gradients(0, 1, urls, extra + ["data.train.negatives_key=null"])
    assert plain["loss"] < one_pass["loss"] and rel_error(flat(plain["grads"]), flat(one_pass["grads"])) > 1e-3


def two_ranks(rank: int, world: int, urls: str) -> dict:
    return gradients(rank, world, urls, ["loss=infcl", "loss.tile=8", "trainer.sub_batch=4",
                                         "model.image.patch_dropout=0"])


def test_two_ranks_with_negatives_equal_one_process(urls, tmp_path):
    single = gradients(0, 1, urls, ["loss=infcl", "loss.tile=8", "model.image.patch_dropout=0"])  # ranks draw apart
    for result in run_ranks(2, two_ranks, urls, tmp_path=tmp_path):
        assert rel_error(result["loss"], single["loss"]) <= 1e-6
        assert rel_error(flat(result["grads"]), flat(single["grads"])) <= 1e-5


def test_the_sigmoid_loss_and_bad_keys_are_refused():
    with pytest.raises(ConfigError, match=r"data\.train\.negatives_key=json:negatives with SigLipLoss"):
        validate(compose("loss=siglip", "data.train.negatives_key=json:negatives"))
    with pytest.raises(ConfigError, match=r"data\.train\.negatives="):
        validate(compose("data.train.negatives=0"))
    # checked once, at start-up (the step raised it twice, at its first step)
    with pytest.raises(ConfigError, match=r"loss\.caption_weight=1\.0 with hard negatives .*loss\.caption_weight=0"):
        validate(compose("model=tiny_coca", "loss.caption_weight=1.0", "data.train.negatives_key=json:negatives"))
