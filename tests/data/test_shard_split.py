"""Shard-split loading: epoch mode over 2 ranks x 2 workers sees every sample exactly once,
resampled mode repeats exactly from the same seed, and a resume continues where a run stopped."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megabatch.data import TrainData
from megabatch.data.shard_writer import Sample, encode_png, write_shards

from ..helpers import compose, preprocess

SHARDS, PER_SHARD = 8, 10


@pytest.fixture(scope="module")
def shard_urls(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("shards")
    pixels = np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    samples = [Sample(encode_png(pixels), "png", f"sample {i}") for i in range(SHARDS * PER_SHARD)]
    write_shards(samples[: SHARDS * PER_SHARD // 2], folder, "a", per_shard=PER_SHARD)
    write_shards(samples[SHARDS * PER_SHARD // 2 :], folder, "b", per_shard=PER_SHARD)
    return [str(folder / "a-{000000..000003}.tar"), str(folder / "b-{000000..000003}.tar")]


def sample_ids(texts: torch.Tensor) -> list[int]:
    return texts.tolist()


def make_data(urls, *overrides) -> TrainData:
    cfg = compose("data=webdataset", "data.train.split=shard", "data.num_workers=2", "data.train.shuffle_buffer=7",
                  *overrides)
    cfg.data.train.urls = urls
    ids = lambda captions: torch.tensor([int(c.split()[-1]) for c in captions])  # noqa: E731
    return TrainData(cfg.data, ids, preprocess(8), seed=cfg.seed)


def epoch_ids(data: TrainData, rank: int, steps: int, start: int = 0, epoch: int = 0) -> list[list[int]]:
    loader = data.loader(epoch, start, rank_batch=10, rank=rank, world_size=2, num_batches=steps,
                         sub_batch=5)
    return [sample_ids(batch.texts) for batch in loader]


def test_epoch_mode_sees_every_sample_exactly_once(shard_urls):
    data = make_data(shard_urls)
    steps = data.steps_per_epoch(global_batch=20, world_size=2, sub_batch=5)
    assert steps == 4  # 80 samples / (2 ranks x 2 sub-batches x 5)
    seen = [i for rank in (0, 1) for sub in epoch_ids(data, rank, steps) for i in sub]
    assert sorted(seen) == list(range(SHARDS * PER_SHARD))
    next_epoch = [i for rank in (0, 1) for sub in epoch_ids(data, rank, steps, epoch=1) for i in sub]
    assert sorted(next_epoch) == list(range(SHARDS * PER_SHARD)) and next_epoch != seen  # reshuffled


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
def test_a_resumed_loader_continues_the_same_stream(shard_urls, mode):
    data = make_data(shard_urls, f"data.train.mode={mode}")
    full = epoch_ids(data, 0, 4)
    assert epoch_ids(data, 0, 4, start=2) == full[4:]  # 2 steps x 2 sub-batches already done


def test_resampled_mode_repeats_exactly_from_the_seed(shard_urls):
    first = epoch_ids(make_data(shard_urls, "data.train.mode=resampled"), 1, 6)
    again = epoch_ids(make_data(shard_urls, "data.train.mode=resampled"), 1, 6)
    other = epoch_ids(make_data(shard_urls, "data.train.mode=resampled", "seed=1"), 1, 6)
    assert first == again and first != other
    weighted = epoch_ids(make_data(shard_urls, "data.train.mode=resampled",
                                   "data.train.weights=[1.0,0.0]"), 0, 6)
    assert all(i < 40 for sub in weighted for i in sub)  # all from source a


def test_bad_shard_layouts_are_clear_errors(shard_urls):
    from megabatch.config import ConfigError

    with pytest.raises(ConfigError, match="weights"):
        make_data(shard_urls, "data.train.weights=[1.0]")
    with pytest.raises(ConfigError, match="shards for"):
        make_data(shard_urls, "data.num_workers=8").steps_per_epoch(20, 2, 5)


def test_persistent_redecode_workers_reproduce_the_first_decode(shard_urls):
    """Offload: kept bytes re-decoded by the worker pool (2 steps in a row, bounded look-ahead)
    equal the loader's first decode bit for bit, in order."""
    from megabatch.data.offload import Offload

    data = make_data(shard_urls, "data.num_workers=2")
    offload = Offload(data.transform, data.seed, workers=2)
    try:
        for epoch in (0, 1):
            loader = data.loader(epoch=epoch, start_batch=0, rank_batch=10, rank=0, world_size=1,
                                 num_batches=3, sub_batch=5, keep_raw=True)
            first = [(sub.images, offload.keep(sub.raw)) for sub in loader]
            again = list(offload.replay_images([raw for _, raw in first], epoch))
            assert len(again) == len(first) == 6
            for (images, _), redecoded in zip(first, again, strict=True):
                assert torch.equal(images, redecoded)
    finally:
        offload.close()


def _die(epoch, raw, spill_path=None):
    os._exit(1)  # a worker killed from outside (the OOM killer) looks like this to the pool


def test_a_killed_redecode_worker_is_an_error_not_a_hang(shard_urls, monkeypatch):
    from megabatch.data import offload

    monkeypatch.setattr(offload, "_redecode_sub_batch", _die)
    redecoder = offload.Redecoder(transform=None, seed=0, workers=1, timeout_s=2)
    try:
        with pytest.raises(RuntimeError, match="re-decode worker gave no sub-batch"):
            next(redecoder([[(b"", 0)]], epoch=0))
    finally:
        redecoder.close()
