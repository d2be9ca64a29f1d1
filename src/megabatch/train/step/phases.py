"""A step's phase seconds without stopping the host: on CUDA an event recorded on the current stream at each
phase boundary, read only once the times are asked for (the log reads them every ``trainer.log_every`` steps,
after its own host sync); on the CPU the host's clock. The host's own waits (``data``: for the loader) are host
seconds, subtracted from the phase they fell in."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import torch


class PhaseTimes(Mapping):
    """``{phase: seconds}`` of one step, resolved on first read. ``start`` opens a phase at the current point of
    the device's stream, ``stop(name, minus)`` closes it: its seconds less the host seconds ``minus`` (waits that
    fell inside it); ``add`` records host seconds directly (and adds to an existing entry)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host: dict[str, float] = {}
        self.spans: list[tuple[str, object, object, float]] = []  # (name, start, end, host seconds to subtract)
        self._opened = None
        self._resolved: dict[str, float] | None = None

    def _point(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: no host sync
        return event

    def start(self) -> None:
        self._opened = self._point()

    def stop(self, name: str, minus: float = 0.0) -> None:
        self.spans.append((name, self._opened, self._point(), minus))
        self._opened = None

    def add(self, name: str, seconds: float) -> None:
        self.host[name] = self.host.get(name, 0.0) + seconds
        self._resolved = None

    def _resolve(self) -> dict[str, float]:
        if self._resolved is None:
            times = dict(self.host)
            for name, start, end, minus in self.spans:
                if self.cuda:
                    end.synchronize()  # host sync, when read: the step's work is done by then
                    seconds = start.elapsed_time(end) / 1000.0
                else:
                    seconds = end - start
                times[name] = max(0.0, seconds - minus)
            self._resolved = times
        return self._resolved

    def __getitem__(self, name: str) -> float:
        return self._resolve()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolve())

    def __len__(self) -> int:
        return len(self._resolve())
