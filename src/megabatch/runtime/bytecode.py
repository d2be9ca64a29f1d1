"""Bytecode for an interpreter that does not keep its own.

Python compiles each module's source to bytecode on import and keeps it beside the source
(``__pycache__``), unless told not to (``PYTHONDONTWRITEBYTECODE=1``, set by many container images)
or unable to (a read-only install). An environment whose packages were installed without bytecode
(uv's default, ``pip --no-compile``) then compiles torch, open_clip and the rest from source at every
start: ``import megabatch.train`` took 13.0-14.4 s on the H100 machine (whose image is such), 7.6-8.3 s
with bytecode (2026-11-26).

``use_kept_bytecode`` (at ``import megabatch``): where torch has no bytecode beside its source, Python
reads bytecode from ``<cache>/pycache`` instead (``sys.pycache_prefix``, ``PYTHONPYCACHEPREFIX`` for
the processes this one starts; ``<cache>``: ``$MEGABATCH_CACHE``, else ``~/.cache/megabatch``), and
``write_missing_bytecode`` (after a run's first step) compiles the modules this process imported
without it there, in a background process at the lowest priority, for the next start. Nothing is
written next to the sources. Python checks each file against its source's size and time, so a
changed package is compiled again. A process started by such a process (a benchmark's runs, a
launcher's jobs) keeps its folder; a ``PYTHONPYCACHEPREFIX`` of the user's own is left alone.
``MEGABATCH_PYCACHE=0`` turns this off.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

_MARK = "MEGABATCH_PYCACHE_FOLDER"  # the folder use_kept_bytecode chose, for the processes this one starts
_compiler: subprocess.Popen | None = None  # kept: it runs on after this process

_COMPILE = """
import os, py_compile, sys
os.nice(19)
for path in sys.stdin.read().splitlines():
    py_compile.compile(path, doraise=False, quiet=2)
"""


def bytecode_folder() -> Path:
    """``<cache>/pycache``."""
    return Path(os.environ.get("MEGABATCH_CACHE") or "~/.cache/megabatch").expanduser() / "pycache"


def use_kept_bytecode(probe: str = "torch") -> Path | None:
    """Read bytecode from ``bytecode_folder()`` where the ``probe`` package's is not beside its
    source (see the module's note). Returns the folder, or None where nothing was changed."""
    if os.environ.get("MEGABATCH_PYCACHE", "1") == "0":
        return None
    if sys.pycache_prefix is not None:  # set by the user, or inherited from a megabatch process (kept then)
        return Path(sys.pycache_prefix) if in_use() else None
    spec = importlib.util.find_spec(probe)  # found, not imported
    if spec is None or not spec.cached or os.path.exists(spec.cached):
        return None
    folder = bytecode_folder()
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = os.environ[_MARK] = str(folder)
    return folder


def in_use() -> bool:
    """Whether bytecode is read from a folder ``use_kept_bytecode`` chose (here or in the process
    that started this one)."""
    return sys.pycache_prefix is not None and sys.pycache_prefix == os.environ.get(_MARK)


def write_missing_bytecode() -> int:
    """With ``use_kept_bytecode``'s folder in use: compile there, in a background process, the
    modules this process imported from source without bytecode. Returns how many it was given."""
    if not in_use():
        return 0
    missing = sorted({module.__file__ for module in list(sys.modules.values())
                      if isinstance(getattr(module, "__file__", None), str) and module.__file__.endswith(".py")
                      and not os.path.exists(importlib.util.cache_from_source(module.__file__))})
    if not missing:
        return 0
    global _compiler
    try:
        _compiler = compiler = subprocess.Popen([sys.executable, "-c", _COMPILE], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHONPYCACHEPREFIX": sys.pycache_prefix}, text=True)
        compiler.stdin.write("\n".join(missing))
        compiler.stdin.close()
    except OSError:
        return 0
    return len(missing)
