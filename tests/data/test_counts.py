"""Sample counts where they are: sizes.json, img2dataset's _stats.json, a header scan and its cache
all give the true count; streams without counts are a clear error."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from megabatch.config import ConfigError
from megabatch.data import urls as urls_module
from megabatch.data.urls import expand_urls, scan_tar, shard_sizes

from ..helpers import ROOT, preprocess

TRUTH = [7, 3, 12, 5]


def write_tar(path, samples: int, extensions=("jpg", "txt", "json")) -> None:
    """An img2dataset-style shard: ``samples`` keys, one member per extension each."""
    with tarfile.open(path, "w") as tar:
        for key in range(samples):
            for ext in extensions:
                data = f"{key}.{ext}".encode()
                info = tarfile.TarInfo(f"{key:09d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def shards(tmp_path):
    folder = tmp_path / "cc12m"
    folder.mkdir()
    for index, samples in enumerate(TRUTH):
        write_tar(folder / f"{index:05d}.tar", samples)
    return folder, str(folder / "{00000..00003}.tar")


def no_scan(path):
    raise AssertionError(f"scanned {path}")


def test_img2dataset_stats_give_the_counts_without_opening_a_tar(shards, tmp_path, monkeypatch):
    folder, pattern = shards
    for index, samples in enumerate(TRUTH):
        (folder / f"{index:05d}_stats.json").write_text(json.dumps({"count": samples + 2, "successes": samples}))
    monkeypatch.setattr(urls_module, "scan_tar", no_scan)
    assert shard_sizes(expand_urls(pattern, "k"), "k", tmp_path / "cache") == TRUTH


def test_header_scan_then_cache_then_rescan_when_a_shard_changes(shards, tmp_path, monkeypatch):
    folder, pattern = shards
    urls = expand_urls(pattern, "k")
    assert [scan_tar(url) for url in urls] == TRUTH
    assert shard_sizes(urls, "k", tmp_path / "cache") == TRUTH  # scanned
    cached = json.loads((tmp_path / "cache" / "shard_counts.json").read_text())
    assert sorted(entry[2] for entry in cached.values()) == sorted(TRUTH)
    with monkeypatch.context() as patch:
        patch.setattr(urls_module, "scan_tar", no_scan)
        assert shard_sizes(urls, "k", tmp_path / "cache") == TRUTH  # from the cache alone
    write_tar(folder / "00002.tar", 4)  # rewritten: new size and mtime
    os.utime(folder / "00002.tar", ns=(1, 1))
    assert shard_sizes(urls, "k", tmp_path / "cache") == [7, 3, 4, 5]


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_many_shards_are_counted_in_a_process_a_core(shards, tmp_path, monkeypatch, start):
    """From ``SCAN_PROCESSES_FROM`` shards on, the header scans run in processes (started as the loader's
    workers are: forked, or from the fork server), with the same counts, in the shards' order, and cached."""
    from concurrent.futures import ProcessPoolExecutor

    from megabatch.data.worker_start import worker_context

    folder, pattern = shards
    urls = expand_urls(pattern, "k")
    pools = []
    monkeypatch.setattr(urls_module, "SCAN_PROCESSES_FROM", 4)
    monkeypatch.setattr(urls_module, "ProcessPoolExecutor",
                        lambda *args, **kwargs: pools.append(ProcessPoolExecutor(*args, **kwargs)) or pools[-1])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # two cores, whatever CI has
    assert shard_sizes(urls, "k", tmp_path / "cache", mp_context=worker_context(start)) == TRUTH
    assert len(pools) == 1 and pools[0]._max_workers == 2
    monkeypatch.setattr(urls_module, "scan_tar", no_scan)
    assert shard_sizes(urls, "k", tmp_path / "cache") == TRUTH  # cached


@pytest.mark.parametrize("worker_start", ["fork", "forkserver"])
def test_a_runs_count_forks_its_processes_whatever_starts_the_loaders_workers(shards, tmp_path, monkeypatch,
                                                                            worker_start):
    """TrainData counts in processes forked from the training process, also where the loader's workers come from
    the fork server (``data.worker_start``): at that point of a start the server is still importing."""
    from concurrent.futures import ProcessPoolExecutor

    from megabatch.data import TrainData

    from ..helpers import compose

    folder, pattern = shards
    pools = []
    monkeypatch.setattr(urls_module, "SCAN_PROCESSES_FROM", 4)
    monkeypatch.setattr(urls_module, "ProcessPoolExecutor",
                        lambda *args, **kwargs: pools.append(ProcessPoolExecutor(*args, **kwargs)) or pools[-1])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = compose("data=webdataset", f"data.train.urls='{pattern}'", f"data.cache_dir={tmp_path / 'cache'}",
                  f"data.worker_start={worker_start}")
    data = TrainData(cfg.data, lambda captions: captions, preprocess(8), seed=0)
    assert data.sizes == TRUTH
    assert len(pools) == 1 and pools[0]._mp_context.get_start_method() == "fork"


def test_sizes_json_wins_and_a_shard_it_misses_is_counted(shards, tmp_path):
    folder, pattern = shards
    (folder / "sizes.json").write_text(json.dumps({"00000.tar": 7, "00001.tar": 3}))
    assert sum(shard_sizes(expand_urls(pattern, "k"), "k", tmp_path / "cache")) == sum(TRUTH)


def test_a_truncated_tar_counts_the_samples_before_the_damage(tmp_path):
    write_tar(tmp_path / "a.tar", 10)
    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "b.tar").write_bytes(data[: len(data) // 2])
    assert 0 < scan_tar(tmp_path / "b.tar") < 10
    (tmp_path / "c.tar").write_bytes(b"not a tar at all")
    assert scan_tar(tmp_path / "c.tar") == 0


def odd_tars(folder) -> dict[str, bool]:
    """Tars of every header kind a shard may hold, each with whether the header reader should count it alone
    (True) or hand it to tarfile (False)."""
    made = {}

    def write(name, fmt, members, plain, mode="w"):
        with tarfile.open(folder / name, mode, format=fmt) as tar:
            for member, kind in members:
                info = tarfile.TarInfo(member)
                info.type = kind
                data = b"" if kind != tarfile.REGTYPE else member.encode() * 3
                info.size = len(data)
                if kind == tarfile.SYMTYPE:
                    info.linkname = "elsewhere"
                tar.addfile(info, io.BytesIO(data))
        made[name] = plain

    files = [(f"{key:09d}.{ext}", tarfile.REGTYPE) for key in range(5) for ext in ("jpg", "txt")]
    # names told apart only by what a 100-byte name field cannot hold: a reader that missed the ustar prefix, the GNU
    # long name or the pax path would join their samples
    long = [(f"{folder * 120}/000000001.{ext}", tarfile.REGTYPE) for folder in "pq" for ext in ("jpg", "json")]
    write("ustar.tar", tarfile.USTAR_FORMAT, files + long, True)
    write("gnu.tar", tarfile.GNU_FORMAT, files + [(f"{'y' * 200}{key}.jpg", tarfile.REGTYPE) for key in "ab"], True)
    write("pax.tar", tarfile.PAX_FORMAT, files + [(f"{'z' * 300}{key}.jpg", tarfile.REGTYPE) for key in "ab"]
          + [("é/ü.txt", tarfile.REGTYPE)], True)
    write("folders.tar", tarfile.PAX_FORMAT, [("shards", tarfile.DIRTYPE), *files], True)
    with tarfile.open(folder / "sparse.tar", "w", format=tarfile.PAX_FORMAT) as tar:  # a GNU sparse member in pax
        info = tarfile.TarInfo("000000000.jpg")
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "9"}
        data = b"1\n0\n9\n".ljust(512, b"\0") + b"123456789"  # the map (one region: 9 bytes at 0), then the bytes
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    made["sparse.tar"] = False
    write("links.tar", tarfile.PAX_FORMAT, [*files[:4], ("000000009.jpg", tarfile.SYMTYPE), *files[4:]], False)
    write("zipped.tar.gz", tarfile.PAX_FORMAT, files, False, mode="w:gz")
    whole = (folder / "pax.tar").read_bytes()
    (folder / "cut.tar").write_bytes(whole[: len(whole) // 2 + 100])  # inside a member's data
    made["cut.tar"] = False
    damaged = bytearray(whole)
    damaged[512 * 6 + 3] ^= 0xFF  # a later header's name: its checksum fails
    (folder / "damaged.tar").write_bytes(bytes(damaged))
    made["damaged.tar"] = False
    (folder / "ended.tar").write_bytes(whole[: 512 * 8])  # no end-of-archive blocks, cut between members
    made["ended.tar"] = True
    return made


def test_the_header_reader_counts_as_tarfile_does_and_hands_it_what_it_does_not_read(tmp_path, monkeypatch):
    """``scan_tar`` reads plain tars' headers itself (ustar with prefixes, GNU long names, pax paths, folders, a tar
    without its end blocks) and gives tarfile's count; links, compression, a bad checksum and data cut short go to
    tarfile."""
    made = odd_tars(tmp_path)
    truth = {name: urls_module._scan_with_tarfile(tmp_path / name) for name in made}
    assert truth["ustar.tar"] == 7 and truth["gnu.tar"] == 7 and truth["pax.tar"] == 8
    handed = []
    reference = urls_module._scan_with_tarfile
    monkeypatch.setattr(urls_module, "_scan_with_tarfile", lambda path: handed.append(path.name) or reference(path))
    for name, plain in made.items():
        assert scan_tar(tmp_path / name) == truth[name], name
        assert (name not in handed) == plain, (name, handed)


def test_the_indexed_splits_offsets_from_the_header_reader_are_tarfiles(tmp_path, monkeypatch):
    """``indexed_split.scan_offsets`` (each sample's first header, then the end of the last member) gives the same
    index through ``tars.tar_headers`` as through tarfile, for every kind of tar, and the index reads the samples."""
    import numpy as np

    from megabatch.data import indexed_split
    from megabatch.data.tars import NotPlain

    made = odd_tars(tmp_path)
    read = {name: indexed_split.scan_offsets(tmp_path / name) for name in made}

    def tarfile_only(path):
        raise NotPlain("the reference: tarfile")
        yield

    monkeypatch.setattr(indexed_split, "tar_headers", tarfile_only)
    for name in made:
        assert np.array_equal(read[name], indexed_split.scan_offsets(tmp_path / name)), name
    offsets = read["pax.tar"]
    assert len(offsets) == 8 + 1
    with tarfile.open(tmp_path / "pax.tar") as tar:  # each offset is a sample's first member, extended header and all
        firsts = {member.offset for member in tar.getmembers()}
    assert set(offsets[:-1].tolist()) <= firsts


def test_a_sparse_member_without_its_map_counts_what_precedes_it(tmp_path, caplog):
    """tarfile raises ValueError (not a TarError) on a GNU sparse member whose map does not parse: the count and the
    index keep the samples before it, with a warning, as for any damage."""
    import logging

    from megabatch.data.indexed_split import scan_offsets

    with tarfile.open(tmp_path / "bad.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for key in range(3):
            info = tarfile.TarInfo(f"{key:09d}.jpg")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"jpeg"))
        info = tarfile.TarInfo("000000003.jpg")
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "9"}
        info.size = 9
        tar.addfile(info, io.BytesIO(b"no map at"))
    with caplog.at_level(logging.WARNING):
        assert scan_tar(tmp_path / "bad.tar") == 3
        assert len(scan_offsets(tmp_path / "bad.tar")) == 3  # two whole samples before the one being read, and the end
    assert "counted the 3 samples before it" in caplog.text and "indexed the 2 samples before it" in caplog.text


@pytest.mark.parametrize("url", ["pipe:aws s3 cp s3://bucket/{0..3}.tar -", "https://host/{0..3}.tar"])
def test_streams_without_counts_name_num_samples_and_resampled(url):
    with pytest.raises(ConfigError, match=r"data\.train\.num_samples.*data\.train\.mode=resampled"):
        sum(shard_sizes(expand_urls(url, "data.train.urls"), "data.train.urls"))


def test_make_shards_index_writes_sizes_json(shards, tmp_path):
    folder, pattern = shards
    (folder / "00000_stats.json").write_text(json.dumps({"successes": 7}))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shards.py"), "index", pattern],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MEGABATCH_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert f"4 shards, {sum(TRUTH)} samples" in result.stdout
    assert json.loads((folder / "sizes.json").read_text()) == {f"{i:05d}.tar": n for i, n in enumerate(TRUTH)}


def test_training_data_counts_img2dataset_shards(shards, tmp_path):
    from megabatch.config.compose import compose
    from megabatch.data import TrainData

    _, pattern = shards
    cfg = compose("data=webdataset", f"data.train.urls='{pattern}'", f"data.cache_dir={tmp_path / 'cache'}")
    data = TrainData(cfg.data, lambda texts: None, preprocess(32), seed=0, show_progress=False)
    assert data.num_samples == sum(TRUTH) and data.sizes == TRUTH
    streams = compose("data=webdataset", "data.train.urls='pipe:cat /d/{0..3}.tar'", "data.train.num_samples=400",
                      "data.train.mode=resampled")
    assert TrainData(streams.data, lambda texts: None, preprocess(32), seed=0).num_samples == 400


@pytest.mark.parametrize("processes", [False, True])
def test_the_indexed_splits_count_builds_the_tar_indexes_its_workers_read(shards, tmp_path, monkeypatch, processes):
    """Counting the shards for the indexed split is the header scan that builds each shard's tar index: cached
    where the loader's workers look, so they read samples without scanning a shard again."""
    from megabatch.config.compose import compose
    from megabatch.data import TrainData, indexed_split
    from megabatch.data.indexed_split import INDEX_DIR, TarIndex

    folder, pattern = shards
    if processes:
        monkeypatch.setattr(urls_module, "SCAN_PROCESSES_FROM", 2)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = compose("data=webdataset", f"data.train.urls='{pattern}'", f"data.cache_dir={tmp_path / 'cache'}",
                  "data.train.split=indexed")
    data = TrainData(cfg.data, lambda texts: None, preprocess(32), seed=0, show_progress=False)
    assert data.sizes == TRUTH and len(list((tmp_path / "cache" / INDEX_DIR).glob("*.npy"))) == len(TRUTH)
    monkeypatch.setattr(indexed_split, "scan_offsets", no_scan)
    index = TarIndex(tmp_path / "cache")
    for number, samples in enumerate(TRUTH):
        url = str(folder / f"{number:05d}.tar")
        assert index.read(url, samples - 1)["__key__"] == f"{samples - 1:09d}" and index.read(url, samples) is None
    index.close()


def counted_on_two_ranks(rank: int, world: int, pattern: str, cache: str, broken: bool):
    """Rank 1 must not scan: its counts come from rank 0 (or rank 0's error reaches it)."""
    from megabatch.config.compose import compose
    from megabatch.data import TrainData

    if rank == 1:
        urls_module.scan_tar = no_scan
    urls = "pipe:cat /d/{0..3}.tar" if broken else pattern
    cfg = compose("data=webdataset", f"data.train.urls='{urls}'", f"data.cache_dir={cache}")
    try:
        return TrainData(cfg.data, lambda texts: None, preprocess(32), seed=0, show_progress=False).sizes
    except ConfigError as error:
        return f"ConfigError: {error}"


@pytest.mark.parametrize("broken", [False, True])
def test_rank_zero_counts_for_every_rank(shards, tmp_path, broken):
    from ..helpers import run_ranks

    _, pattern = shards
    results = run_ranks(2, counted_on_two_ranks, pattern, str(tmp_path / "cache"), broken, tmp_path=tmp_path)
    if broken:  # rank 0's error, on both ranks, instead of rank 1 waiting for counts
        assert all(r.startswith("ConfigError: data.train.urls: the sample count of remote shards") for r in results)
    else:
        assert results == [TRUTH, TRUTH]
