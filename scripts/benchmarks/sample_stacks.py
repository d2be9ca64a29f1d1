"""Run a Python script with its main thread's stack sampled at a fixed interval, for where a start-up's wall time goes:
unlike cProfile (whose Python 3.12 profile mixes the threads' calls), each sample is the main thread's stack at that
moment, whatever the other threads do.

    python scripts/benchmarks/sample_stacks.py OUT.json train.py model=vit_b16 ...
    python scripts/benchmarks/sample_stacks.py --summary OUT.json      # the seconds under each function, inclusive

OUT.json: ``interval_s``, the distinct ``stacks`` (outermost frame first, each ``file:function``) and ``samples``
([seconds since the start, stack index]) of the main thread, and ``threads``: each other thread's samples by its name
(the loader's start, its pinning, the GPU decoding), written when the script ends. A sample's weight is the time to
the next one (the sampler waits for the interpreter's lock like any thread). ``startup.py --sample`` runs one warm
row this way (``--sample-cache cold``: a cold one).
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys
import threading
import time
from collections import Counter

INTERVAL_S = 0.005


def sample(out: str, interval_s: float = INTERVAL_S) -> None:
    """Sample the calling (main) thread's stack every ``interval_s`` until the process exits; write ``out`` then."""
    main, started = threading.get_ident(), time.perf_counter()
    stacks: dict[tuple, int] = {}
    samples: list[tuple[float, int]] = []
    threads: dict[str, list[tuple[float, int]]] = {}  # the other threads' samples, by name
    done = threading.Event()

    def stack_of(frame) -> int:
        names = []
        while frame is not None:
            code = frame.f_code
            names.append(f"{code.co_filename}:{code.co_name}")
            frame = frame.f_back
        return stacks.setdefault(tuple(reversed(names)), len(stacks))

    def run() -> None:
        me = threading.get_ident()
        while not done.wait(interval_s):
            now = round(time.perf_counter() - started, 4)
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == main:
                    samples.append((now, stack_of(frame)))
                elif ident != me:
                    threads.setdefault(f"{names.get(ident, 'unnamed')}-{ident}", []).append((now, stack_of(frame)))

    def write() -> None:
        done.set()
        with open(out, "w") as file:
            json.dump({"interval_s": interval_s, "stacks": [list(key) for key in stacks], "samples": samples,
                       "threads": threads}, file)

    threading.Thread(target=run, daemon=True, name="stack-sampler").start()
    atexit.register(write)


def summary(path: str, top: int = 80, within: str = "", start: float = 0.0, stop: float = float("inf")) -> str:
    """The seconds each function was on the main thread's stack between ``start`` and ``stop`` (inclusive, once per
    sample, each sample weighted by the time to the next), the largest first; ``within``: only functions whose file
    contains it."""
    data = json.load(open(path))
    stacks, samples = data["stacks"], data["samples"]
    seconds: Counter = Counter()
    total = 0.0
    for (at, index), (after, _) in zip(samples, samples[1:], strict=False):
        if start <= at < stop:
            total += after - at
            for name in set(stacks[index]):
                if within in name:
                    seconds[name] += after - at
    lines = [f"{total:.2f} s sampled"] + [f"{s:7.2f} s  {name}" for name, s in seconds.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        print(summary(sys.argv[2], within=sys.argv[3] if len(sys.argv) > 3 else ""))
    else:
        out, script = sys.argv[1], sys.argv[2]
        sys.argv = sys.argv[2:]
        sample(out)
        runpy.run_path(script, run_name="__main__")
