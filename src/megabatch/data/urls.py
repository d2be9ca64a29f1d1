"""Shard lists: brace patterns expanded to files, and each shard's sample count from wherever it
already is (``sizes.json``, img2dataset's ``<shard>_stats.json``), else from one scan of the tar's
headers (in a process a core where there are many), cached under the cache dir."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import braceexpand
from tqdm.auto import tqdm

from ..config import ConfigError

log = logging.getLogger(__name__)

COUNTS_CACHE = "shard_counts.json"  # under the cache dir: {realpath: [size, mtime_ns, samples]}
SCAN_THREADS = 16                   # a few shards: scanned in threads, several reads in flight on a network disk
SCAN_PROCESSES_FROM = 64            # more: in a process a core (parsing headers holds the interpreter lock: threads
                                    # counted 6-12 shards/s on a 16-core host whatever their number)
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.[^/]*$")  # webdataset's grouping: the name up to the first dot


def is_remote(url: str) -> bool:
    """``pipe:`` commands and ``scheme://`` URLs: read as streams, never listed or scanned."""
    return "://" in url or url.startswith("pipe:")


def expand_urls(urls: str | list[str], key: str) -> list[str]:
    """Brace-expand ``urls`` (a string with ``::`` separators, or a list). Local paths must exist:
    a pattern that matches no file is an error naming ``key``."""
    patterns = urls.split("::") if isinstance(urls, str) else list(urls)
    expanded: list[str] = []
    for pattern in patterns:
        for url in braceexpand.braceexpand(pattern):
            if is_remote(url):
                expanded.append(url)
                continue
            matches = sorted(glob.glob(os.path.expanduser(url)))
            if not matches:
                raise ConfigError(f"{key}: {url!r} matches no file (from pattern {pattern!r})")
            expanded.extend(matches)
    if not expanded:
        raise ConfigError(f"{key} is empty; give shard paths such as /data/train-{{000000..000099}}.tar")
    return expanded


def shard_sizes(urls: list[str], key: str, cache_dir: str | os.PathLike | None = None,
                show_progress: bool = True, read_sizes_json: bool = True, mp_context=None,
                scan: Callable[[str], int] | None = None) -> list[int]:
    """Each shard's sample count, taken from the first of: ``sizes.json`` beside it (what
    ``scripts/make_shards.py`` writes), img2dataset's ``<shard>_stats.json`` (``successes``), the
    counts cache under ``cache_dir`` (keyed by path, size and modification time), one scan of the
    tar's headers (no decoding; its result is cached; from ``SCAN_PROCESSES_FROM`` shards on, in a process
    a core, started by ``mp_context``: the loader's fork server in a GPU run, ``None``: fork; ``scan``: what
    scans one, ``scan_tar`` unless given: the indexed split builds its tar index in the same pass). Remote URLs
    have no counts: an error naming ``data.train.num_samples``. ``read_sizes_json=False`` ignores existing
    ``sizes.json`` files."""
    remote = [url for url in urls if is_remote(url)]
    if remote:
        raise ConfigError(
            f"{key}: the sample count of remote shards such as {remote[0]!r} cannot be read; set "
            "data.train.num_samples=<total> (approximate is fine with data.train.mode=resampled, which "
            "draws shards with replacement), or list the shards locally with a sizes.json "
            "(scripts/make_shards.py index '<pattern>')")
    sizes: dict[str, int] = {}
    listed: dict[Path, dict] = {}
    unknown: list[str] = []
    for url in urls:
        path = Path(os.path.expanduser(url))
        folder = path.parent
        if folder not in listed:
            listed[folder] = _read_sizes_json(folder / "sizes.json") if read_sizes_json else {}
        if path.name in listed[folder]:
            sizes[url] = int(listed[folder][path.name])
        elif (stats := _read_stats(path)) is not None:
            sizes[url] = stats
        else:
            unknown.append(url)
    if unknown:
        sizes.update(_scanned_sizes(unknown, cache_dir, show_progress, mp_context, scan or scan_tar))
    return [sizes[url] for url in urls]


def _read_sizes_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path} cannot be read ({error}); fix or delete it (scripts/make_shards.py "
                          "index rewrites it)") from None


def _read_stats(path: Path) -> int | None:
    """``successes`` of img2dataset's ``<stem>_stats.json`` beside ``path`` (``00042.tar`` ->
    ``00042_stats.json``), or None."""
    stats = path.with_name(path.name.split(".")[0] + "_stats.json")
    if not stats.exists():
        return None
    try:
        return int(json.loads(stats.read_text())["successes"])
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("%s has no readable 'successes' count; counting %s instead", stats, path.name)
        return None


def scan_tar(path: str | os.PathLike) -> int:
    """Samples in one tar, from its headers only (consecutive members sharing a key are one sample,
    as webdataset groups them). A truncated tar counts what precedes the damage. A plain tar (ustar, pax or GNU
    long-name headers: what img2dataset and webdataset write) is read by ``tars.tar_headers`` (5 ms for a shard of
    512 samples, against tarfile's 50); anything else (compressed, links, a damaged header, data cut short) by
    tarfile, as before."""
    from .tars import NotPlain, sample_starts, tar_headers  # (tars imports this module)

    try:
        return len(sample_starts(tar_headers(path))[0])
    except (NotPlain, OSError):
        return _scan_with_tarfile(path)


def _scan_with_tarfile(path: str | os.PathLike) -> int:
    from .tars import sample_starts, tarfile_members

    members, error = tarfile_members(path, "r:*")
    samples = len(sample_starts(members)[0])
    if error is not None:
        log.warning("%s: %s; counted the %d samples before it", path, error, samples)
    return samples


def _scanned_sizes(urls: list[str], cache_dir, show_progress: bool, mp_context=None,
                   scan: Callable[[str], int] = scan_tar) -> dict[str, int]:
    """Counts of shards with no listed count: from the cache where the file is unchanged, else by
    scanning (in threads, or for many shards in a process a core; a progress bar after two seconds), then
    cached."""
    cache_file = Path(os.path.expanduser(str(cache_dir))) / COUNTS_CACHE if cache_dir else None
    cache = _load_cache(cache_file)
    sizes: dict[str, int] = {}
    todo: list[tuple[str, str, list[int]]] = []
    for url in urls:
        real = os.path.realpath(os.path.expanduser(url))
        stat = os.stat(real)
        entry = cache.get(real)
        if entry and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            sizes[url] = int(entry[2])
        else:
            todo.append((url, real, [stat.st_size, stat.st_mtime_ns]))
    if not todo:
        return sizes
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    processes = min(cores, len(todo)) if len(todo) >= SCAN_PROCESSES_FROM and cores > 1 else 0
    log.info("counting the samples of %d shards without sizes.json or _stats.json (headers only, once, %s; "
             "cached in %s)", len(todo), f"{processes} processes" if processes else "in threads",
             cache_file or "memory")
    started, first = time.perf_counter(), None
    pool = ProcessPoolExecutor(processes, mp_context=mp_context) if processes else \
        ThreadPoolExecutor(min(SCAN_THREADS, len(todo)))
    with pool:
        # in chunks, a few a process: results come back in order, a chunk at a time, with few messages
        chunk = max(1, len(todo) // (8 * max(1, processes)))
        counts = pool.map(scan, [real for _, real, _ in todo], chunksize=chunk)
        for (url, real, key), count in tqdm(zip(todo, counts, strict=True), total=len(todo), desc="counting samples",
                                            unit="shard", delay=2, disable=not show_progress):
            first = first or time.perf_counter() - started
            sizes[url] = count
            cache[real] = [*key, count]
    _save_cache(cache_file, cache)
    took = time.perf_counter() - started
    # the first result waits for the pool's start (with a fork server, for the server's own start) and one chunk
    log.info("counted the samples of %d shards in %.1f s (%.0f shards/s; the first %d after %.1f s)", len(todo), took,
             len(todo) / max(took, 1e-9), chunk, first)
    return sizes


def _load_cache(cache_file: Path | None) -> dict:
    if cache_file is None or not cache_file.exists():
        return {}
    try:
        return json.loads(cache_file.read_text())
    except (OSError, ValueError):
        log.warning("%s is unreadable; counting again", cache_file)
        return {}


def _save_cache(cache_file: Path | None, cache: dict) -> None:
    """Atomic replace: ranks counting the same shards at once each leave a whole file."""
    if cache_file is None:
        return
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=COUNTS_CACHE, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(cache, out)
        os.replace(tmp, cache_file)
    except OSError as error:  # a read-only cache dir costs a rescan next time, nothing else
        log.warning("could not write the shard counts cache %s: %s", cache_file, error)


def write_sizes(urls: list[str], cache_dir=None, show_progress: bool = True) -> dict[Path, dict[str, int]]:
    """Write (or update) ``sizes.json`` beside ``urls`` with their counts, taken from img2dataset's
    stats or the tars themselves (not from the ``sizes.json`` being rewritten); return each file
    written with the counts it gained."""
    by_folder: dict[Path, dict[str, int]] = {}
    sizes = shard_sizes(urls, "shards", cache_dir, show_progress, read_sizes_json=False)
    for url, size in zip(urls, sizes, strict=True):
        path = Path(os.path.expanduser(url))
        by_folder.setdefault(path.parent, {})[path.name] = size
    for folder, sizes in by_folder.items():
        existing = _read_sizes_json(folder / "sizes.json")
        existing.update(sizes)
        (folder / "sizes.json").write_text(json.dumps(existing, indent=1, sort_keys=True))
    return {folder / "sizes.json": sizes for folder, sizes in by_folder.items()}
