"""Counting the samples of shards without sizes.json or _stats.json (a run's start-up, once per shard set):
the header scans in threads side by side with a process a core (``urls.SCAN_PROCESSES_FROM`` shards on), and in
processes with tarfile reading the headers (``urls._scan_with_tarfile``: before ``scan_tar``'s own reader), in one
run, alternating, each from an empty counts cache; the shards in the page cache for both (one untimed scan
first), so what is timed is the parsing, not the disk.

    python scripts/benchmarks/counting.py --shards 256 --samples 1000 --out counting.json

Writes ``--shards`` img2dataset-style shards of ``--samples`` samples (``.jpg``, ``.txt`` and ``.json`` members of a
few bytes: a header each, as a real shard has) under ``--workdir``, then counts them ``--rounds`` times each way.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from bench import write_results

from megabatch.data import urls


def write_shards(folder: Path, shards: int, samples: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(shards):
        path = folder / f"{index:05d}.tar"
        paths.append(str(path))
        if path.exists():
            continue
        with tarfile.open(path, "w") as tar:
            for key in range(samples):
                for ext in ("jpg", "txt", "json"):
                    data = f"{index}/{key}.{ext}".encode()
                    info = tarfile.TarInfo(f"{key:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return paths


# each way of counting: in threads or processes, with scan_tar (its header reader) or with tarfile alone (before)
SIDES = {"threads": (False, None), "processes": (True, None), "processes, tarfile": (True, urls._scan_with_tarfile)}


def timed_count(paths: list[str], processes: bool, scan=None) -> tuple[float, int]:
    """Seconds to count every shard from an empty cache, threads or processes, and the samples counted."""
    urls.SCAN_PROCESSES_FROM = 1 if processes else len(paths) + 1
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        sizes = urls.shard_sizes(paths, "shards", cache, show_progress=False, scan=scan)
        return time.perf_counter() - start, sum(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--samples", type=int, default=1000, help="samples a shard")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/counting-bench")
    parser.add_argument("--out", default="counting.json")
    args = parser.parse_args()
    paths = write_shards(Path(args.workdir), args.shards, args.samples)
    for path in paths:  # into the page cache: the scans below parse, they do not wait for the disk
        Path(path).read_bytes()
    seconds = {side: [] for side in SIDES}
    total = None
    for _ in range(args.rounds):
        for side, (processes, scan) in SIDES.items():
            elapsed, counted = timed_count(paths, processes, scan)
            seconds[side].append(elapsed)
            assert total in (None, counted), (total, counted)  # both ways count the same
            total = counted
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    medians = {side: statistics.median(values) for side, values in seconds.items()}
    result = {"shards": args.shards, "samples_per_shard": args.samples, "samples": total, "cores": cores,
              "threads": urls.SCAN_THREADS, "seconds": seconds, "median_s": medians,
              "shards_per_s": {side: args.shards / value for side, value in medians.items()},
              "processes_over_threads": medians["threads"] / medians["processes"],
              "reader_over_tarfile": medians["processes, tarfile"] / medians["processes"]}
    print(f"{args.shards} shards of {args.samples} samples on {cores} cores: " + ", ".join(
        f"{side} {medians[side]:.2f} s ({result['shards_per_s'][side]:.0f} shards/s)" for side in SIDES)
        + f"; processes over threads {result['processes_over_threads']:.2f}x, the header reader over tarfile "
        f"{result['reader_over_tarfile']:.2f}x", flush=True)
    write_results(args.out, [result], command="counting", args=vars(args))


if __name__ == "__main__":
    main()
