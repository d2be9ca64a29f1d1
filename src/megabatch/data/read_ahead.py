"""Read the loader ahead of the trainer in a background thread, within a host-memory budget.

Why: a GradCache step consumes its sub-batches in phase 1 only. During the loss and the replay
(two thirds of a step) the main thread does not ask the DataLoader for anything, so its workers stop
once their few prefetch slots (``prefetch_factor x num_workers`` sub-batches) are full, and the next
step's phase 1 waits for the data the workers could have made meanwhile. ``ReadAhead`` keeps asking:
a thread takes sub-batches from the DataLoader (already decoded by the worker processes, and pinned
by its pin thread on CUDA) into a queue bounded by bytes, so the workers stay busy through the
replay and the next phase 1 finds its inputs waiting.

The budget counts the items' own bytes. On CUDA they sit in page-locked blocks from torch's host
caching allocator, which rounds each up to a power of two, so the memory held can reach twice it.

Only worker-process loaders are read ahead: with ``num_workers=0`` the thread itself would run the
augmentation, which seeds torch's global CPU generator per sample while the main thread captures
that generator's state for the replay.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator

import torch

from .samples import EncodedImages


def held_bytes(item, seen: set | None = None) -> int:
    """Host bytes an item holds: its tensors', byte strings' and ``EncodedImages``' sizes (each of
    those once: a sub-batch's images and its offload bytes share one), through tuples, lists and dicts."""
    seen = set() if seen is None else seen
    if isinstance(item, EncodedImages):
        if id(item) in seen:
            return 0
        seen.add(id(item))
        return item.nbytes()
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return len(item)
    if isinstance(item, dict):
        return sum(held_bytes(value, seen) for value in item.values())
    if isinstance(item, (tuple, list)):
        return sum(held_bytes(value, seen) for value in item)
    return 0


class ReadAhead:
    """Iterate ``source`` in a daemon thread, holding up to ``budget_bytes`` of items (always at
    least one) that the consumer has not taken yet. Items come out in order; an exception raised
    by ``source`` is raised by ``next`` once the items before it are taken. ``close`` stops it."""

    def __init__(self, source: Iterator, budget_bytes: int, name: str = "megabatch-read-ahead"):
        self._source = source
        self._budget = int(budget_bytes)
        self._items: collections.deque = collections.deque()
        self._held = 0
        self._peak = 0
        self._cond = threading.Condition()
        self._finished = False  # the source is exhausted or raised
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def peak_bytes(self) -> int:
        """The most bytes held at once so far."""
        return self._peak

    def _run(self) -> None:
        try:
            for item in self._source:
                size = held_bytes(item)
                with self._cond:
                    while self._items and self._held + size > self._budget and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        return
                    self._items.append((item, size))
                    self._held += size
                    self._peak = max(self._peak, self._held)
                    self._cond.notify_all()
                del item  # a closed reader must not keep the last item alive in this frame
        except BaseException as error:  # handed to the consumer, raised there
            with self._cond:
                self._error = error
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self):
        with self._cond:
            while not self._items and not self._finished and not self._closed:
                self._cond.wait()
            if self._items:
                item, size = self._items.popleft()
                self._held -= size
                self._cond.notify_all()
                return item
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration

    def close(self, timeout_s: float = 5.0) -> None:
        """Drop what is held and stop the thread (it ends after the item it is waiting for, if any)."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._held = 0
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._source = None
