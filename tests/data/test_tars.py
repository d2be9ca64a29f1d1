"""The loader's own tar reader gives webdataset's samples, byte for byte, and counts a damaged shard
as webdataset's reader does."""

from __future__ import annotations

import gzip
import io
import os
import tarfile

import pytest
import webdataset as wds

from megabatch.data.tars import tar_members, tar_records, tar_samples


def members(count: int = 5, long: bool = False) -> list[tuple[str, bytes]]:
    folder = "d" * 120 + "/" if long else "part/"
    out = []
    for index in range(count):
        stem = f"{folder}sample{index:04d}" + ("é" if index == 2 else "")
        out += [(f"{stem}.jpg", os.urandom(700 + 513 * index)), (f"{stem}.TXT", f"caption {index}".encode()),
                (f"{stem}.json", b"{}")]
    return [("__meta__", b"not a field"), ("noextension", b"x"), *out]


def write_tar(path, items, form=tarfile.PAX_FORMAT, mtime=1.5) -> str:
    with tarfile.open(path, "w", format=form) as tar:
        for name, data in items:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime  # a float mtime: a pax header before every member
            tar.addfile(info, io.BytesIO(data))
        folder = tarfile.TarInfo("a-folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    return str(path)


def both(urls: list[str]) -> tuple[list[dict], list, list[dict], list]:
    ours_errors, theirs_errors = [], []
    ours = list(tar_samples(lambda error: ours_errors.append(error) or True)(iter({"url": u} for u in urls)))
    theirs = list(wds.tarfile_to_samples(handler=lambda error: theirs_errors.append(error) or True)(
        iter({"url": u} for u in urls)))
    return ours, ours_errors, theirs, theirs_errors


@pytest.mark.parametrize("form", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_samples_equal_webdatasets_for_every_tar_format(tmp_path, form):
    long = form != tarfile.USTAR_FORMAT  # ustar cannot hold a 120-character folder name
    items = [(name, data) for name, data in members(long=long) if form != tarfile.USTAR_FORMAT or name.isascii()]
    urls = [write_tar(tmp_path / "a.tar", items, form, mtime=1 if form == tarfile.USTAR_FORMAT else 1.5),
            write_tar(tmp_path / "b.tar", members(3))]
    ours, ours_errors, theirs, theirs_errors = both(urls)
    assert not ours_errors and not theirs_errors
    assert ours == theirs and len(ours) == len(items) // 3 + 3
    assert {"jpg", "txt", "json"} <= set(ours[0]) and ours[0]["__url__"] == urls[0]


def test_a_small_read_size_gives_the_same_records(tmp_path):
    path = write_tar(tmp_path / "a.tar", members())
    with open(path, "rb") as handle:
        small = list(tar_records(handle.read, chunk_bytes=100))
    with open(path, "rb") as handle:
        assert small == list(tar_records(handle.read)) and len(small) == 2 + 15


def test_a_damaged_shard_goes_to_the_handler_with_its_url_and_the_next_is_read(tmp_path):
    good = write_tar(tmp_path / "good.tar", members(3))
    cut = write_tar(tmp_path / "cut.tar", members(6))
    size = os.path.getsize(cut)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar file at all" * 50)
    for cut_at in (size // 2 + 100, 512 * 12, size - 10240):  # in a member, between members, its end blocks
        with open(cut, "r+b") as handle:
            handle.truncate(cut_at)
        urls = [good, cut, str(junk), str(tmp_path / "missing.tar"), good]
        ours, ours_errors, theirs, theirs_errors = both(urls)
        assert [error.args[-1] for error in ours_errors] == [cut, str(junk), str(tmp_path / "missing.tar")]
        assert [sample["__key__"] for sample in ours] == [sample["__key__"] for sample in theirs]
        assert len(ours) <= 3 + 6 + 3 and ours[:3] == theirs[:3] and ours[-3:] == theirs[-3:]
        assert len(theirs_errors) >= 2  # (webdataset's own reader reports a file cut between members or not)
        cut = write_tar(tmp_path / "cut.tar", members(6))


def test_a_handler_that_gives_up_raises():
    def give_up(error):
        return False

    with pytest.raises(FileNotFoundError):
        list(tar_samples(give_up)(iter([{"url": "/no/such/shard.tar"}])))


def test_compressed_shards_are_read_by_webdataset(tmp_path):
    plain = write_tar(tmp_path / "a.tar", members(3))
    packed = tmp_path / "a.tar.gz"
    packed.write_bytes(gzip.compress(open(plain, "rb").read()))
    ours, ours_errors, theirs, _ = both([str(packed)])
    assert not ours_errors and ours == theirs and len(ours) == 3


def test_a_run_of_records_needs_no_end_blocks_and_a_header_cut_short_is_an_error(tmp_path):
    data = open(write_tar(tmp_path / "a.tar", members(2), tarfile.USTAR_FORMAT, mtime=1), "rb").read()
    # __meta__ and noextension: a header and a padded block each; then the first jpg's header at 2048
    assert [name for name, _ in tar_members(data[:2048])] == ["__meta__", "noextension"]  # no end blocks
    with pytest.raises(tarfile.ReadError, match="cut short"):
        list(tar_members(data[:2048 + 512 + 300]))  # the jpg's header, then part of its 700 bytes


def test_a_compressed_shard_cut_in_a_member_counts_once_under_its_url(tmp_path, caplog):
    # webdataset's reader reports the member's error with only its stream, then the shard's with the URL
    from megabatch.data.samples import Stats

    plain = write_tar(tmp_path / "a.tar", members(6))
    packed = gzip.compress(open(plain, "rb").read())
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(packed[:len(packed) // 2])
    stats = Stats(give_up_after=2)
    with caplog.at_level("WARNING", logger="megabatch.data.samples"):
        samples = list(tar_samples(stats.handler)(iter({"url": u} for u in [str(cut), plain])))
    assert stats.broken_shard == 1 and stats.broken_urls == {str(cut)} and stats.broken_in_a_row == 1
    assert len(samples) >= 6 and samples[-1]["__url__"] == plain  # the next shard is read
    [record] = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert f"shard {cut}: unexpected end of data" in record.getMessage() and " @ " not in record.getMessage()
