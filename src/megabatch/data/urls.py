"""Shard lists: brace patterns expanded to files, and their sample counts from ``sizes.json``."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import braceexpand

from ..config import ConfigError


def expand_urls(urls: str | list[str], key: str) -> list[str]:
    """Brace-expand ``urls`` (a string with ``::`` separators, or a list). Local paths must exist:
    a pattern that matches no file is an error naming ``key``."""
    patterns = urls.split("::") if isinstance(urls, str) else list(urls)
    expanded: list[str] = []
    for pattern in patterns:
        for url in braceexpand.braceexpand(pattern):
            if "://" in url or url.startswith("pipe:"):
                expanded.append(url)
                continue
            matches = sorted(glob.glob(os.path.expanduser(url)))
            if not matches:
                raise ConfigError(f"{key}: {url!r} matches no file (from pattern {pattern!r})")
            expanded.extend(matches)
    if not expanded:
        raise ConfigError(f"{key} is empty; give shard paths such as /data/train-{{000000..000099}}.tar")
    return expanded


def count_samples(urls: list[str], key: str) -> int:
    """Total samples in ``urls`` from the ``sizes.json`` files beside them."""
    total = 0
    cache: dict[Path, dict] = {}
    for url in urls:
        folder = Path(url).parent
        if folder not in cache:
            sizes = folder / "sizes.json"
            if not sizes.exists():
                raise ConfigError(
                    f"{key}: no sizes.json beside {url}; write one (scripts/make_shards.py does) "
                    "or set data.train.num_samples"
                )
            cache[folder] = json.loads(sizes.read_text())
        if Path(url).name not in cache[folder]:
            raise ConfigError(f"{key}: {url} is not listed in {folder / 'sizes.json'}; add its sample count "
                              "there (scripts/make_shards.py writes it) or set data.train.num_samples")
        total += int(cache[folder][Path(url).name])
    return total
