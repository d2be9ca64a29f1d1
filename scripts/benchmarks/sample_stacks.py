"""Run a Python script with its main thread's stack sampled at a fixed interval, for where a start-up's wall time goes:
unlike cProfile (whose Python 3.12 profile mixes the threads' calls), each sample is the main thread's stack at that
moment, whatever the other threads do.

    python scripts/benchmarks/sample_stacks.py OUT.json train.py model=vit_b16 ...
    python scripts/benchmarks/sample_stacks.py --summary OUT.json      # the seconds under each function, inclusive

OUT.json: ``interval_s``, the distinct ``stacks`` (outermost frame first, each ``file:function``) and ``samples``
([seconds since the start, stack index]), written when the script ends. ``startup.py --sample`` runs one warm row this
way.
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
    done = threading.Event()

    def run() -> None:
        while not done.wait(interval_s):
            frame = sys._current_frames().get(main)
            names = []
            while frame is not None:
                code = frame.f_code
                names.append(f"{code.co_filename}:{code.co_name}")
                frame = frame.f_back
            key = tuple(reversed(names))
            samples.append((round(time.perf_counter() - started, 4), stacks.setdefault(key, len(stacks))))

    def write() -> None:
        done.set()
        with open(out, "w") as file:
            json.dump({"interval_s": interval_s, "stacks": [list(key) for key in stacks], "samples": samples}, file)

    threading.Thread(target=run, daemon=True, name="stack-sampler").start()
    atexit.register(write)


def summary(path: str, top: int = 80, within: str = "") -> str:
    """The seconds each function was on the main thread's stack (inclusive, once per sample), the largest first;
    ``within``: only functions whose file contains it."""
    data = json.load(open(path))
    stacks, counts = data["stacks"], Counter(index for _, index in data["samples"])
    seconds: Counter = Counter()
    for index, count in counts.items():
        for name in set(stacks[index]):
            if within in name:
                seconds[name] += count * data["interval_s"]
    total = sum(counts.values()) * data["interval_s"]
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
