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


def test_a_run_over_bad_shards_finishes_and_reports(tmp_path, caplog):
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
    # the epoch's counts in one line at its end (the workers log only the first few of each kind)
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 0: bad input on rank 0")]
    assert len(summary) == 1 and "corrupt_image 3" in summary[0], summary


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


def test_a_broken_shard_is_counted_once_with_the_indexed_split_and_several_workers(tmp_path):
    """Each of the 2 workers meets the junk shard (its samples are dealt to both): once per epoch and rank."""
    urls = shards_with_junk(tmp_path / "shards", good_shards=2)
    record = run_on(tmp_path, urls, "data.train.split=indexed")
    assert record["data/broken_shard"] == 1


def unreadable_shards(folder) -> str:
    """Three shards cut to 5,000 bytes, listed in sizes.json at their whole counts (what a failed copy leaves)."""
    write_shards([good(i) for i in range(120)], folder, "t", per_shard=40)
    for path in folder.glob("t-*.tar"):
        os.truncate(path, 5000)
    return str(folder / "t-{000000..000002}.tar")


@pytest.mark.parametrize("start, extra", [
    ("fork", []), ("forkserver", []),
    ("fork", ["trainer.sub_batch=8"]),                           # GradCache: the loader read ahead by a thread
    ("fork", ["trainer.sub_batch=8", "trainer.offload=true"]),  # the offload's re-decoders
], ids=["fork", "forkserver", "read-ahead", "offload"])
def test_a_run_whose_shards_are_all_unreadable_exits_within_seconds(tmp_path, start, extra):
    """The error reaches the user and the process ends, its loader workers (which ignore SIGTERM) with it:
    before, it waited forever in multiprocessing's exit handler. status.json names the worker's own error, and
    the workers' warnings are summarised (the first few of each kind, not one a sample)."""
    import subprocess
    import sys
    import time

    from ..helpers import ROOT

    urls = unreadable_shards(tmp_path / "shards")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "data=webdataset", f"data.train.urls={urls}", "data.num_workers=2",
         f"data.worker_start={start}", "batch=16", "trainer.max_steps=5", "eval=none", f"run_dir={tmp_path / 'run'}",
         *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    assert "no usable sample" in result.stderr and "unreadable shards" in result.stderr
    assert took < 60, f"{took:.0f} s"  # the run itself fails in seconds; no wait on its workers
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed"
    assert status["error"].startswith("RuntimeError: no usable sample") and "t-000000.tar" in status["error"]
    assert "DataLoader worker process" in status["error"]  # where it happened, after what
    for kind in ("broken_shard", "missing_caption"):  # each worker: at most 3 a kind, then one line saying so
        assert result.stderr.count(f"further {kind} warnings") <= 2
    assert result.stderr.count("its missing samples are skipped") <= 2 * 3


def test_the_reaper_kills_workers_that_ignore_sigterm():
    """``end_children``: a worker that ignores SIGTERM and never ends is killed after the bounded wait."""
    import multiprocessing

    from megabatch.runtime.signals import end_children

    process = multiprocessing.get_context("fork").Process(target=_ignore_and_sleep, daemon=True, name="stubborn")
    process.start()
    import time

    time.sleep(0.5)  # its handler set
    process.terminate()  # ignored
    process.join(0.5)
    assert process.is_alive()
    assert end_children(timeout_s=0.5) == ["stubborn"]
    assert not process.is_alive()


def _ignore_and_sleep() -> None:
    import time

    from megabatch.runtime.signals import ignore_stop_signals

    ignore_stop_signals()
    time.sleep(600)


def test_the_status_names_a_loader_workers_own_error():
    from megabatch.report.runs import failure

    wrapped = RuntimeError("Caught RuntimeError in DataLoader worker process 1.\nOriginal Traceback (most recent "
                           "call last):\n  File \"x.py\", line 3, in f\n    raise\nRuntimeError: no usable sample: "
                           "unreadable shards ['/d/a.tar']\n")
    assert failure(wrapped) == ("RuntimeError: no usable sample: unreadable shards ['/d/a.tar'] "
                                "(DataLoader worker process 1)")
    assert failure(ValueError("plain")) == "ValueError: plain"


def test_the_default_worker_count_fits_the_machine(monkeypatch):
    from megabatch.config import loader_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert loader_workers(8) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    assert loader_workers(8) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert loader_workers(8) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert compose("data=webdataset").data.num_workers == 1  # 2 cores shared by 8 ranks: at least one
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert compose("data=webdataset").data.num_workers == 2 and compose("eval=imagenet").eval.imagenet.num_workers == 2


def test_a_stream_whose_command_fails_mid_shard_is_skipped_and_counted(tmp_path):
    """``pipe:`` streams (the shard split): one whose command stops half-way through its shard and exits non-zero
    (a dropped connection) is skipped and counted under its URL; the loader goes on with the other streams and
    fills every sub-batch, without waiting on it."""
    import time

    import torch

    from megabatch.data import TrainData

    from ..helpers import preprocess

    write_shards([good(i) for i in range(40)], tmp_path, "s", per_shard=10)
    tars = sorted(tmp_path.glob("s-*.tar"))
    cut = f"pipe:head -c {tars[1].stat().st_size // 2} {tars[1]}; exit 3"
    cfg = compose("data=webdataset", "data.train.split=shard", "data.num_workers=1", "data.train.shuffle_buffer=7",
                  "data.train.num_samples=40")
    cfg.data.train.urls = [f"pipe:cat {tars[0]}", cut, f"pipe:cat {tars[2]}", f"pipe:cat {tars[3]}"]
    numbers = lambda captions: torch.tensor([int(caption.split()[-1]) for caption in captions])  # noqa: E731
    data = TrainData(cfg.data, numbers, preprocess(16), seed=0, show_progress=False)
    started = time.monotonic()
    subs = list(data.loader(0, 0, rank_batch=5, rank=0, world_size=1, num_batches=6, sub_batch=5))
    assert time.monotonic() - started < 60
    assert [len(sub.texts) for sub in subs] == [5] * 6
    seen = [number for sub in subs for number in sub.texts.tolist()]
    assert len(set(seen)) == 30 and 19 not in seen and len(set(seen) & set(range(10, 20))) < 10  # cut short
    assert subs[-1].stats["broken_shard"] == 1 and list(subs[-1].stats["broken_urls"]) == [cut]


def test_naflex_skips_and_counts_images_of_a_shape_it_cannot_take(tmp_path):
    """A NaFlex tower's data path: an image with a side shorter than one patch, or an aspect ratio beyond
    ``data.naflex.max_aspect`` (1 x 4000), is skipped and counted as ``bad_shape``; the others are packed."""
    import numpy as np

    from megabatch.data.naflex import NaFlexSpec
    from megabatch.data.samples import SampleDecoder, Stats, decode_pair
    from megabatch.data.shard_writer import encode_png

    decoder = SampleDecoder(NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(16,)), seed=0, epoch=0)
    stats = Stats()
    shapes = {"thin": (1, 4000), "tiny": (4, 30), "fine": (24, 40)}
    kept = {}
    for key, (height, width) in shapes.items():
        sample = {"__key__": key, "png": encode_png(np.zeros((height, width, 3), dtype=np.uint8)), "txt": b"x"}
        pair = decode_pair(sample, stats, decoder.decode, decoder.captions, 0, decoder.image_keys)
        if pair is not None:
            kept[key] = decoder(pair[1], 0)
    assert stats.bad_shape == 2 and stats.corrupt_image == 0 and list(kept) == ["fine"]
    assert kept["fine"].shape == (16, 3 * 64 + 4)
