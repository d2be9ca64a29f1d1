"""Files written whole: a reader (another rank, a node sharing the folder, the next run) sees the old file, the
new one, or none, never half of one."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path


def replace_whole(path: Path, write: Callable[[Path], object]) -> None:
    """``write(partial)`` fills a file beside ``path`` under a name no other writer has (whatever process or host),
    which then replaces ``path`` in one rename; its folder is made first, and a partial file left by a failed write is
    removed. Raises what ``write`` or the rename raise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def replace_json(path: Path, value, indent: int | None = None) -> None:
    """``value`` as JSON (one line, or ``indent``ed) written whole to ``path`` (``replace_whole``)."""
    replace_whole(path, lambda partial: partial.write_text(json.dumps(value, indent=indent) + "\n"))
