"""Config helpers: human-friendly counts (``1M``, ``256k``) and errors that name the key; the typed
schema and its checks are in ``schema.py``, ``compose`` in ``compose.py``."""

from __future__ import annotations

import re
from typing import Any

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")


class ConfigError(ValueError):
    """A config value is unusable; the message names the key and the fix."""


def no_such_option(key: str, options) -> str:
    """The message for an unknown ``key`` (dotted) among ``options`` (the names valid at its place): the
    closest names first, then every option where none is close."""
    import difflib

    prefix, _, name = key.rpartition(".")
    options = sorted(str(option) for option in options)
    close = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
    where = f"{prefix}." if prefix else ""
    if close:
        others = f" (or {', '.join(where + c for c in close[1:])})" if len(close) > 1 else ""
        return f"{key}: no such option; did you mean {where}{close[0]}?{others}"
    return f"{key}: no such option; the options are {', '.join(options)}"


def parse_count(value: Any, key: str = "batch") -> int:
    """Parse a sample count: ``65536``, ``256k`` (= 262,144) or ``1M`` (= 1,048,576).

    Suffixes are binary (k = 1024, M = 1024**2, G = 1024**3), as batch sizes are in the
    literature ("1M batch" = 1,048,576). Raises ``ConfigError`` naming ``key`` for anything else.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a sample count; use e.g. {key}=65536, 256k or 1M")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    else:
        match = _COUNT.match(str(value))
        if match is None:
            raise ConfigError(
                f"{key}={value!r} is not a sample count; use an integer or a k/M suffix, "
                f"e.g. {key}=65536, {key}=256k or {key}=1M"
            )
        scaled = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
        if not scaled.is_integer():
            raise ConfigError(f"{key}={value!r} is not a whole number of samples")
        number = int(scaled)
    if number <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive number of samples")
    return number


_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_TOTAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbBgGtT]?)\s*$")


def parse_samples_total(value: Any, key: str = "trainer.max_samples") -> int:
    """Parse a number of samples seen: ``12.8M`` (= 12,800,000), ``1.28B``, ``400000``.

    Decimal suffixes (k = 1e3, M = 1e6, B or G = 1e9), as data-seen budgets are quoted (DataComp's
    12.8M, 128M, 1.28B); batch sizes (``parse_count``) are binary. Raises ``ConfigError`` naming ``key``.
    """
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        number = int(value)
    else:
        match = _TOTAL.match(str(value))
        number = round(float(match.group(1)) * _DECIMAL[match.group(2).lower()]) if match else None
    if number is None or number <= 0:
        raise ConfigError(f"{key}={value!r} is not a positive number of samples; use e.g. {key}=12.8M "
                          f"(12,800,000: k, M and B are decimal here), {key}=1B or {key}=400000")
    return number


def parse_optional_count(value: Any, key: str) -> int | None:
    """Like ``parse_count`` but ``None`` stays ``None`` (an unset option)."""
    return None if value is None else parse_count(value, key)


def parse_duration(value, key: str = "trainer.time_limit") -> float | None:
    """``3h50m``, ``90m``, ``45s``, ``1h``, or a number of seconds; ``null`` -> None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    match = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?\s*", str(value))
    if not match or not any(match.groups()):
        raise ConfigError(f"{key}={value!r}: give a duration such as 3h50m, 90m or 45s (or seconds), or null")
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    total = 3600 * hours + 60 * minutes + seconds
    if total <= 0:
        raise ConfigError(f"{key}={value!r} must be longer than zero")
    return float(total)


def package_dir(module: str, *parts: str) -> str:
    """Folder of an installed Python package (plus ``parts``): ``${mb.package_dir:pkg,model}``
    points a config at model files that ship inside a wheel, with no download."""
    import importlib.util
    import os

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"${{mb.package_dir:{module}}}: the package {module!r} is not installed "
            f"(pip install {module.replace('_', '-')}) or set the path explicitly"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


def output_dir(run_dir: str | None, name: str) -> str:
    """``${mb.output_dir:${run_dir},${name}}``, Hydra's output dir of a single run: ``run_dir`` where one is given, so
    that its log (``train.log``) and its composed config (``.hydra/``) are written beside the checkpoints, not in a
    ``runs/<name>`` of their own; else ``runs/<name>``."""
    return str(run_dir) if run_dir else f"runs/{name}"


def loader_workers(most: int = 8) -> int:
    """``${mb.workers:8}``: loader workers per rank, at most ``most`` and no more than this machine's cores
    shared among the ranks on it (``LOCAL_WORLD_SIZE``, torchrun's): 2 on a 2-core machine, where 8 workers
    only compete with the step (torch warns), 8 a rank on a GPU node's 16 cores or more."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(int(most), cores // ranks))


def register_resolvers() -> None:
    """OmegaConf resolvers and the typed schemas (``schema.py``) used by configs/ (idempotent)."""
    from omegaconf import OmegaConf

    from .schema import register

    if not OmegaConf.has_resolver("mb.package_dir"):
        OmegaConf.register_new_resolver("mb.package_dir", package_dir)
    if not OmegaConf.has_resolver("mb.workers"):
        OmegaConf.register_new_resolver("mb.workers", loader_workers)
    if not OmegaConf.has_resolver("mb.output_dir"):
        OmegaConf.register_new_resolver("mb.output_dir", output_dir)
    register()


register_resolvers()
