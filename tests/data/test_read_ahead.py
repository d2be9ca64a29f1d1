"""The loader read-ahead: order, memory bound, errors, shutdown."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megabatch.data.read_ahead import ReadAhead, held_bytes


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_held_bytes_counts_tensors_and_bytes_inside_containers():
    item = (torch.zeros(4, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), [(b"abc", 7)], {"x": b"de"})
    assert held_bytes(item) == 12 + 16 + 3 + 2


def test_items_come_out_in_order_and_all_of_them():
    ahead = ReadAhead(iter(range(1000)), budget_bytes=10)  # ints hold 0 bytes: no bound on count
    assert list(ahead) == list(range(1000))


def test_the_reader_runs_ahead_but_not_past_its_budget():
    produced = []

    def source():
        for index in range(100):
            produced.append(index)
            yield torch.full((100,), index, dtype=torch.uint8)  # 100 bytes each

    ahead = ReadAhead(source(), budget_bytes=250)
    # two items fit; the third is made and waits for room
    assert wait_for(lambda: len(produced) == 3)
    time.sleep(0.2)
    assert len(produced) == 3 and ahead.peak_bytes == 200
    assert next(ahead)[0] == 0  # taking one lets one more in
    assert wait_for(lambda: len(produced) == 4)
    assert [int(t[0]) for t in ahead] == list(range(1, 100))
    assert ahead.peak_bytes == 200


def test_an_item_larger_than_the_budget_still_passes_one_at_a_time():
    ahead = ReadAhead((torch.zeros(1000, dtype=torch.uint8) for _ in range(3)), budget_bytes=10)
    assert len(list(ahead)) == 3 and ahead.peak_bytes == 1000


def test_a_source_error_is_raised_after_the_items_before_it():
    def source():
        yield 1
        yield 2
        raise ValueError("corrupt shard list")

    ahead = ReadAhead(source(), budget_bytes=1)
    assert next(ahead) == 1 and next(ahead) == 2
    with pytest.raises(ValueError, match="corrupt shard list"):
        next(ahead)
    with pytest.raises(StopIteration):
        next(ahead)


def test_close_stops_an_endless_source_and_frees_what_was_held():
    def endless():
        while True:
            yield torch.zeros(10, dtype=torch.uint8)

    ahead = ReadAhead(endless(), budget_bytes=100, name="read-ahead-under-test")
    assert wait_for(lambda: ahead.peak_bytes == 100)
    ahead.close()
    assert not any(t.name == "read-ahead-under-test" for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(ahead)
