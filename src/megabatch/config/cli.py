"""Command lines as users type them: shard patterns such as ``data.train.urls='/data/{000000..041407}.tar'``
reach Hydra with their braces intact.

The shell removes the quotes a user puts around a brace pattern (they stop the shell's own brace
expansion), so Hydra receives ``data.train.urls=/data/{000000..041407}.tar`` and its override grammar
reads ``{`` as the start of a dictionary. The entry points pass ``sys.argv`` through
``quote_patterns`` before Hydra parses it: the value of every ``*.urls`` override that holds a brace
is wrapped in Hydra quotes, piece by piece where a top-level comma makes it a sweep or the value is a
list. Every other override, and a value the user already quoted for Hydra, is left as it came.
"""

from __future__ import annotations

import os
import re
import sys

from . import ConfigError, no_such_option

PATTERN_KEYS = frozenset({"urls"})  # last component of the keys whose values are shard patterns
_OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][\w.\-@/]*)=(.*)$", re.DOTALL)
_FUNCTION = re.compile(r"^\w+\(")  # Hydra sweep functions: choice(...), range(...), glob(...)


def quote_patterns(args: list[str]) -> list[str]:
    """``args`` (an argv without the program name) with brace patterns in ``*.urls`` values quoted
    for Hydra. A ``*.urls`` key given more than once (the shell expanded an unquoted pattern) is an
    error that says to quote it."""
    seen: dict[str, int] = {}
    quoted = []
    for arg in args:
        match = _OVERRIDE.match(arg)
        if match is None or match.group(2).rsplit(".", 1)[-1] not in PATTERN_KEYS:
            quoted.append(arg)
            continue
        prefix, key, value = match.groups()
        seen[key] = seen.get(key, 0) + 1
        quoted.append(f"{prefix}{key}={quote_value(value)}")
    for key, count in seen.items():
        if count > 1:
            raise ConfigError(f"{key} is given {count} times: the shell expanded an unquoted brace pattern; "
                              f"quote it: {key}='/data/shards/{{000000..000099}}.tar'")
    return quoted


def quote_value(value: str) -> str:
    """Quote each piece of ``value`` that holds a brace: a plain value, the items of a ``[...]``
    list, or the comma-separated values of a sweep. Quoted pieces and sweep functions stay as
    they are."""
    if _FUNCTION.match(value):
        return value
    if value.startswith("[") and value.endswith("]"):
        return "[" + ",".join(_quote(item) for item in split_top_level(value[1:-1])) + "]"
    return ",".join(_quote(piece) for piece in split_top_level(value))


def _quote(piece: str) -> str:
    stripped = piece.strip()
    if not any(brace in stripped for brace in "{}") or stripped[:1] in ("'", '"'):
        return piece
    for mark in ("'", '"'):
        if mark not in stripped and "\\" not in stripped:
            return f"{mark}{stripped}{mark}"
    return piece  # holds both quote marks or a backslash: Hydra's own quoting is left to the user


def split_top_level(text: str, separator: str = ",") -> list[str]:
    """``text`` split at ``separator`` outside braces, brackets, parentheses and quotes
    (``/a/{0,1}.tar,/b.tar`` -> ``['/a/{0,1}.tar', '/b.tar']``)."""
    pieces, depth, quote, start = [], 0, None, 0
    for index, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
        elif char == separator and depth == 0:
            pieces.append(text[start:index])
            start = index + 1
    pieces.append(text[start:])
    return pieces


def key_values(argv: list[str], options: dict[str, str | None], example: str, script: str) -> dict[str, str]:
    """A script's ``key=value`` arguments over its ``options`` (defaults; ``None``: required): a
    ``ConfigError`` for an unknown key, a word without ``=`` or a required key not given, with
    ``example`` (``ckpt=... out=...``) as the fix."""
    values = dict(options)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in options:
            raise ConfigError(f"{arg!r}: give key=value with key one of {', '.join(options)}, e.g. {example}")
        values[key] = value
    missing = [key for key, value in values.items() if value is None]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} not given: python {script} {example}")
    return values


def config_error_exit(error: ConfigError) -> SystemExit:
    """What an entry point raises for a ``ConfigError``: one line on stderr naming the key and the
    fix, status 2 (usage), no traceback; with ``HYDRA_FULL_ERROR=1`` the error itself, traceback
    and all."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"config error: {error}", file=sys.stderr)
    return SystemExit(2)


class JobFailed(Exception):
    """A multirun job's error: Hydra records the job as failed and runs the others; the sweep's summary
    shows it, and the sweep ends with its error once every job has run."""


def job_exit(status: SystemExit, message: str) -> BaseException:
    """What an entry point raises to end with ``status``: that ``SystemExit`` in a single run; in a
    Hydra multirun a ``JobFailed`` instead, since a ``SystemExit`` would end the whole sweep at once."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return JobFailed(message)
    return status


def unknown_override(error: BaseException) -> str | None:
    """megabatch's message for Hydra's refusal of an override whose key does not exist ("Could not override
    'trainer.max_step'. To append to your config use +trainer.max_step=5"): the key, the closest valid names
    at its place (``no_such_option``); ``None`` for any other error."""
    from omegaconf import DictConfig
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = error.__cause__
    if type(error).__name__ != "ConfigCompositionException" or \
            not isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or not getattr(cause, "full_key", None):
        return None
    parent = cause.parent_node
    options = list(parent.keys()) if isinstance(parent, DictConfig) else []
    return no_such_option(str(cause.full_key), [o for o in options if not str(o).startswith("_")])


def megabatch_override_errors() -> None:
    """Hydra reports a composition error itself (``run_and_report``) and would advise ``+key=value`` for a
    typo'd key: wrap it so that an unknown key ends as every other config error does (one line naming
    the key and the closest valid names, status 2). Idempotent; any other error is Hydra's as before."""
    from hydra._internal import utils

    original = utils.run_and_report
    if getattr(original, "megabatch", False):
        return

    def run_and_report(func):
        def translated():
            try:
                return func()
            except Exception as error:
                message = unknown_override(error)
                if message is None:
                    raise
                raise config_error_exit(ConfigError(message)) from None

        return original(translated)

    run_and_report.megabatch = True
    utils.run_and_report = run_and_report


def entry_args(args: list[str]) -> list[str]:
    """``quote_patterns`` for an entry point's ``sys.argv[1:]``, its errors as ``config_error_exit``; an
    unknown key's error as megabatch's (``megabatch_override_errors``)."""
    megabatch_override_errors()
    try:
        return quote_patterns(args)
    except ConfigError as error:
        raise config_error_exit(error) from None
