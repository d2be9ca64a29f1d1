"""The indexed split: every global batch holds the same samples, augmented alike, whatever the number
of ranks, loader workers and the sub-batch size; an epoch reads each sample once; a resumed loader
reads no sample before its step; damaged shards are skipped and counted. Also the position split's
batches, which were always independent of the rank count."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from megabatch.config import ConfigError
from megabatch.data import TrainData
from megabatch.data.indexed_split import EpochOrder, TarIndex
from megabatch.data.shard_writer import Sample, encode_png, write_shards

from ..helpers import compose, preprocess

SHARDS, PER_SHARD, BATCH = 6, 10, 12


@pytest.fixture(scope="module")
def shard_urls(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    samples = [Sample(encode_png(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)), "png", f"sample {i}")
               for i in range(SHARDS * PER_SHARD - 3)]  # the last shard 3 short: unequal shards
    write_shards(samples, folder, "s", per_shard=PER_SHARD)
    return [str(folder / f"s-{{000000..{SHARDS - 1:06d}}}.tar")]


def make_data(urls, tmp_path, *overrides) -> TrainData:
    cfg = compose("data=webdataset", "data.train.split=indexed", "data.train.streams=4",
                  "data.train.shuffle_buffer=7", *overrides)
    cfg.data.train.urls, cfg.data.cache_dir = urls, str(tmp_path / "cache")
    ids = lambda captions: torch.tensor([int(c.split()[-1]) for c in captions])  # noqa: E731
    return TrainData(cfg.data, ids, preprocess(8), seed=cfg.seed)


def global_batches(data: TrainData, world: int, sub_batch: int, steps: int, start: int = 0, epoch: int = 0):
    """{step: {sample id: its image}} gathered over ``world`` ranks."""
    batches = {}
    for rank in range(world):
        loader = data.loader(epoch, start, rank_batch=BATCH // world, rank=rank, world_size=world,
                             num_batches=steps, sub_batch=sub_batch)
        per_step = BATCH // world // sub_batch
        for index, sub in enumerate(loader):
            step = batches.setdefault(start + index // per_step, {})
            step.update({int(i): image for i, image in zip(sub.texts, sub.images, strict=True)})
    return batches


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(torch.equal(x[i], y[i]) for i in x) for x, y in
        ((a[k], b[k]) for k in a))


def test_batches_are_the_same_on_any_number_of_ranks_and_workers(shard_urls, tmp_path):
    data = make_data(shard_urls, tmp_path, "data.num_workers=0")
    steps = data.steps_per_epoch(BATCH, 1, BATCH)
    assert steps == (SHARDS * PER_SHARD - 3) // 4 * 4 // BATCH == 4  # 57 samples, 4 streams of 14: 56 read
    one = global_batches(data, world=1, sub_batch=BATCH, steps=steps)
    seen = [i for batch in one.values() for i in batch]
    assert len(seen) == len(set(seen)) == steps * BATCH  # each sample at most once
    assert seen != sorted(seen)  # shuffled
    for world, sub_batch, workers in ((2, 3, 2), (3, 2, 1), (3, 4, 3)):
        other = make_data(shard_urls, tmp_path, f"data.num_workers={workers}")
        assert same(global_batches(other, world, sub_batch, steps), one), (world, sub_batch, workers)
    next_epoch = global_batches(data, world=1, sub_batch=BATCH, steps=steps, epoch=1)
    assert sorted(next_epoch[0]) != sorted(one[0])  # each epoch its own order


def test_a_resumed_loader_reads_from_its_step_on(shard_urls, tmp_path, monkeypatch):
    data = make_data(shard_urls, tmp_path, "data.num_workers=0")
    full = global_batches(data, world=2, sub_batch=3, steps=4)
    read = []
    original = TarIndex.read
    monkeypatch.setattr(TarIndex, "read", lambda self, url, sample: read.append(1) or original(self, url, sample))
    resumed = global_batches(data, world=3, sub_batch=2, steps=4, start=2)
    assert same(resumed, {step: full[step] for step in (2, 3)})
    assert len(read) == 2 * BATCH  # no sample of the first two steps was read


def test_the_order_is_a_function_of_seed_epoch_and_position():
    sizes = [10, 7, 12, 9]
    order = EpochOrder(sizes, seed=3, epoch=1, streams=3, window=5)
    located = order.locate(range(len(order)))
    assert len(order) == 38 // 3 * 3 and len(set(located)) == len(located)  # a permutation of 36 samples
    assert all(0 <= sample < sizes[shard] for shard, sample in located)
    again = EpochOrder(sizes, seed=3, epoch=1, streams=3, window=5)
    assert [again.locate([p])[0] for p in reversed(range(len(order)))] == located[::-1]  # any order of asking
    assert EpochOrder(sizes, seed=4, epoch=1, streams=3, window=5).locate(range(36)) != located


def test_damaged_shards_are_skipped_and_counted(shard_urls, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(shard_urls[0].rsplit("/", 1)[0], folder)
    first = folder / "s-000000.tar"
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])  # truncated: half its samples
    (folder / "s-000001.tar").write_bytes(b"not a tar")
    data = make_data([str(folder / f"s-{{000000..{SHARDS - 1:06d}}}.tar")], tmp_path, "data.num_workers=0")
    loader = data.loader(0, 0, rank_batch=BATCH, rank=0, world_size=1, num_batches=4, sub_batch=BATCH)
    batches = list(loader)
    assert len(batches) == 4 and all(len(b.texts) == BATCH for b in batches)  # filled: no rank waits
    # the missing samples' places taken by the next readable samples at those places of later batches
    assert batches[-1].stats["broken_shard"] == 2 and batches[-1].stats["stand_in"] > 0
    assert batches[-1].stats["padded"] == 0
    assert all(len(set(b.texts.tolist())) == BATCH for b in batches)  # no sample twice in a batch
    ids = {int(i) for b in batches for i in b.texts}
    assert not ids & set(range(PER_SHARD, 2 * PER_SHARD))  # nothing of the unreadable shard
    assert ids & set(range(PER_SHARD // 2 - 1))  # the truncated shard's first samples are read


def test_streams_are_refused_with_the_fix(tmp_path):
    cfg = compose("data=webdataset", "data.train.split=indexed", "data.train.num_samples=100")
    cfg.data.train.urls = "https://example.com/{000000..000003}.tar"
    data = TrainData(cfg.data, lambda captions: captions, preprocess(8), seed=0)
    with pytest.raises(ConfigError, match="split=shard"):
        data.loader(0, 0, rank_batch=4, rank=0, world_size=1, num_batches=1)


def test_the_position_split_gives_the_same_batches_on_any_number_of_ranks(tmp_path):
    cfg = compose("data.train.shuffle_buffer=64")
    data = TrainData(cfg.data, lambda captions: torch.arange(len(captions)), preprocess(32), seed=0)
    data.tokenize = None  # captions kept as they are: they name the sample
    seen = {}
    for world in (1, 2, 3):
        images = []
        for rank in range(world):
            dataset = data.loader(0, 1, rank_batch=BATCH // world, rank=rank, world_size=world, num_batches=2,
                                  sub_batch=2).dataset
            dataset.tokenize = lambda captions: captions
            images += [image for sub in dataset for image in sub.images]
        seen[world] = sorted(image.flatten().tolist() for image in images)
    assert len(seen[1]) == BATCH and seen[1] == seen[2] == seen[3]
