"""Bad input never stops a run: corrupt images, a missing caption and a truncated tar are skipped,
counted by kind and reported, and every rank still gets full sub-batches."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import webdataset as wds

from megabatch.data.shard_writer import Sample, encode_png, write_shards
from megabatch.train import run

from ..helpers import compose


def good(index: int) -> Sample:
    pixels = np.random.default_rng(index).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    return Sample(encode_png(pixels), "png", f"a picture number {index}")


def make_bad_shards(folder) -> str:
    samples = [good(i) for i in range(40)]
    for index in (3, 11, 25):  # corrupt images
        samples[index] = Sample(b"this is not a png", "png", "broken")
    write_shards(samples, folder, "a", per_shard=40)
    write_shards([good(100 + i) for i in range(40)], folder, "c", per_shard=40)
    # a shard with two samples that have no caption
    with wds.TarWriter(str(folder / "b-000000.tar")) as sink:
        for index in range(40):
            sample = {"__key__": f"{index:09d}", "png": good(200 + index).image}
            if index not in (5, 6):
                sample["txt"] = f"caption {index}"
            sink.write(sample)
    # truncate the last shard in the middle of a member
    path = folder / "c-000000.tar"
    os.truncate(path, path.stat().st_size // 2 + 100)
    sizes = json.loads((folder / "sizes.json").read_text())
    sizes["b-000000.tar"] = 40
    (folder / "sizes.json").write_text(json.dumps(sizes))
    return str(folder / "{a,b,c}-000000.tar")


def test_a_run_over_bad_shards_finishes_and_reports(tmp_path):
    urls = make_bad_shards(tmp_path / "shards")
    cfg = compose("data=webdataset", f"data.train.urls='{urls}'", "data.num_workers=0",
                  "batch=16", "trainer.max_steps=7", "trainer.log_every=7", "eval=none",
                  "trainer.sub_batch=8", "data.train.augment.scale=[0.5,1.0]")
    cfg.run_dir = str(tmp_path / "run")
    run(cfg)
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["step"] == 7
    assert record["data/corrupt_image"] == 3
    assert record["data/missing_caption"] >= 2  # (+1 if the cut falls inside a sample)
    assert record["data/broken_shard"] >= 1
    # (data.train.split=auto: indexed) the unusable and missing samples' places were filled with the
    # next readable samples at those places of later batches, none repeated
    assert record["data/stand_in"] > 0 and "data/padded" not in record
    assert 0 <= record["data_wait"] <= 1


def shards_with_junk(folder, junk: int = 1, good_shards: int = 1) -> list[str]:
    """``good_shards`` readable shards of 40 and ``junk`` files that are not tars at all, all listed
    in sizes.json as 40 samples."""
    for index in range(good_shards):
        write_shards([good(100 * index + i) for i in range(40)], folder, f"good{index}", per_shard=40)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = json.loads((folder / "sizes.json").read_text()) if good_shards else {}
    for index in range(junk):
        (folder / f"junk{index}-000000.tar").write_bytes(b"this is not a tar file at all" * 50)
        sizes[f"junk{index}-000000.tar"] = 40
    (folder / "sizes.json").write_text(json.dumps(sizes))
    return sorted(str(path) for path in folder.glob("*.tar"))


def run_on(tmp_path, urls: list[str], *extra: str) -> dict:
    cfg = compose("data=webdataset", "data.num_workers=2", "batch=16", "trainer.sub_batch=8",
                  "trainer.max_steps=4", "trainer.log_every=4", "eval=none", *extra)
    cfg.data.train.urls = urls
    cfg.run_dir = str(tmp_path / "run")
    run(cfg)
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]


def test_a_worker_whose_only_shard_is_not_a_tar_borrows_and_the_run_finishes(tmp_path):
    urls = shards_with_junk(tmp_path / "shards")  # shard split: one worker gets the junk alone
    record = run_on(tmp_path, urls, "data.train.split=shard")
    assert record["step"] == 4
    assert record["data/broken_shard"] == 1  # counted once
    assert record["data/padded"] > 0  # the junk's slot filled its quota from the good shard


def test_a_broken_shard_is_counted_once_with_the_position_split(tmp_path):
    urls = shards_with_junk(tmp_path / "shards", good_shards=2)
    record = run_on(tmp_path, urls, "data.train.split=position")
    assert record["data/broken_shard"] == 1  # every worker reads it; one reports it


def test_no_readable_shard_is_an_error_naming_them(tmp_path):
    import pytest

    urls = shards_with_junk(tmp_path / "shards", junk=2, good_shards=0)
    with pytest.raises(RuntimeError, match=r"unreadable shards.*junk0-000000\.tar"):
        run_on(tmp_path, urls, "data.num_workers=0", "data.train.split=position")


def test_a_shard_missing_from_sizes_json_is_counted_from_its_headers(tmp_path):
    from megabatch.data.urls import shard_sizes

    urls = shards_with_junk(tmp_path / "shards", junk=0)
    (tmp_path / "shards" / "extra-000000.tar").write_bytes((tmp_path / "shards" / "good0-000000.tar").read_bytes())
    assert shard_sizes([*urls, str(tmp_path / "shards" / "extra-000000.tar")], "k", tmp_path / "cache") == [40, 40]


def test_a_resampled_stream_over_unreadable_shards_stops_naming_them(tmp_path):
    import pytest

    urls = shards_with_junk(tmp_path / "shards", junk=2, good_shards=0)
    with pytest.raises(RuntimeError, match=r"no readable shard.*junk"):  # not an endless loop
        run_on(tmp_path, urls, "data.num_workers=0", "data.train.mode=resampled")


@pytest.mark.parametrize("split", ["position", "indexed"])
def test_an_unusable_sample_is_stood_in_for_by_a_later_one_never_repeated(tmp_path, split):
    """A sub-batch short of usable samples (3 corrupt images, 2 captionless samples, a truncated
    shard) takes the next usable samples at the same places of later batches: every global batch
    full, none holding a sample twice (a repeat would be a false negative of itself)."""
    from megabatch.data import TrainData

    from ..helpers import preprocess

    urls = make_bad_shards(tmp_path / "shards")
    cfg = compose("data=webdataset", f"data.train.urls='{urls}'", f"data.train.split={split}", "data.num_workers=0",
                  "data.train.shuffle_buffer=16")
    data = TrainData(cfg.data, lambda captions: captions, preprocess(16), seed=0)  # texts: the captions

    def sub_batches(rank):
        loader = data.loader(0, 0, rank_batch=8, rank=rank, world_size=2, num_batches=4, sub_batch=4)
        return list(loader)

    ranks = [sub_batches(0), sub_batches(1)]
    stats = [rank[-1].stats for rank in ranks]
    assert sum(s["stand_in"] for s in stats) > 0 and all(s["padded"] == 0 for s in stats)
    for step in range(4):  # rank 0's two sub-batches, then rank 1's: one global batch of 16
        captions = [c for rank in ranks for sub in rank[2 * step:2 * step + 2] for c in sub.texts]
        assert len(captions) == 16 and len(set(captions)) == 16, captions
        assert "broken" not in captions
