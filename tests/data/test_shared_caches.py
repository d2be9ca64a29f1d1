"""Per-host caches on a filesystem several nodes share (``$MEGABATCH_CACHE``): two writers at once, as two nodes whose
processes have the same pid, each leave the file whole (a temporary file of a name no other writer has, renamed into
place): the kernels' tuned tile configs and the indexed split's tar indexes."""

from __future__ import annotations

import json
import threading

import numpy as np

from megabatch.data.indexed_split import INDEX_DIR, TarIndex, scan_offsets
from megabatch.kernels import triton_tiles

from .test_counts import write_tar


def hammer(write, read, rounds: int = 150) -> list[BaseException]:
    """``write(writer, round)`` from two threads (one process: one pid, as two nodes' processes may have) while
    ``read()`` checks the file in between; the errors any of them met."""
    errors: list[BaseException] = []
    done = threading.Event()

    def writer(number: int) -> None:
        try:
            for index in range(rounds):
                write(number, index)
        except BaseException as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    def reader() -> None:
        while not done.is_set():
            try:
                read()
            except FileNotFoundError:
                pass  # not written yet
            except BaseException as error:  # noqa: BLE001 - a torn file
                errors.append(error)

    threads = [threading.Thread(target=writer, args=(number,)) for number in (0, 1)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    done.set()
    watcher.join(30)
    return errors


def test_two_writers_of_the_tuned_configs_leave_the_file_whole(tmp_path):
    path = tmp_path / "triton_tuned.json"
    errors = hammer(lambda writer, index: triton_tiles.save_config(f"GPU {writer}", f"key{index}", {"BLOCK": index},
                                                                    path),
                    lambda: json.loads(path.read_text()))
    assert not errors, errors[:3]
    assert json.loads(path.read_text())  # whole, whichever writer was last
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_two_writers_of_a_tar_index_leave_it_whole(tmp_path):
    shard = tmp_path / "00000.tar"
    write_tar(shard, 50)
    expected = scan_offsets(shard)
    cache = tmp_path / "cache"

    def write(writer: int, index: int) -> None:
        for cached in (cache / INDEX_DIR).glob("*.npy"):
            cached.unlink(missing_ok=True)  # scanned and written again
        assert np.array_equal(TarIndex(cache).offsets(shard), expected)

    def read() -> None:
        for cached in (cache / INDEX_DIR).glob("*.npy"):
            assert np.array_equal(np.load(cached), expected)

    errors = hammer(write, read, rounds=60)
    assert not errors, errors[:3]
    assert not list((cache / INDEX_DIR).glob(".*.tmp"))
