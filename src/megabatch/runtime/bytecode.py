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

A cold folder (no bytecode of the probe package's yet: a new machine or cache) is filled while this
process imports: ``precompile`` starts one compiling process per spare core over the packages a run
imports (``PRECOMPILED``), the shallow modules first, and the imports read what they have written. One
process of a node does it (a lock file in the folder); the others import as before.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

_MARK = "MEGABATCH_PYCACHE_FOLDER"  # the folder use_kept_bytecode chose, for the processes this one starts
_compiler: subprocess.Popen | None = None  # kept: it runs on after this process

_COMPILE = """
import os, py_compile, sys
os.nice(19)
for path in sys.stdin.read().splitlines():
    py_compile.compile(path, doraise=False, quiet=2)
"""


# the packages a training run imports, in about the order it imports them (the largest first): compiled in parallel
# into a cold folder (``precompile``); a module outside them is compiled by its importer, and kept after the first step
PRECOMPILED = ("torch", "sympy", "numpy", "timm", "torchvision", "open_clip", "triton", "mpmath", "hydra", "omegaconf",
               "antlr4", "huggingface_hub", "PIL", "webdataset", "yaml", "filelock", "jinja2", "fsspec", "networkx")
_LOCK = ".precompiling"  # in the folder: a process of this node is filling it
_LOCK_STALE_S = 600.0  # a lock older than this was left by a process that died


def bytecode_folder() -> Path:
    """``<cache>/pycache``."""
    return Path(os.environ.get("MEGABATCH_CACHE") or "~/.cache/megabatch").expanduser() / "pycache"


def use_kept_bytecode(probe: str = "torch", packages: tuple[str, ...] = PRECOMPILED) -> Path | None:
    """Read bytecode from ``bytecode_folder()`` where the ``probe`` package's is not beside its
    source (see the module's note); where the folder holds none of the probe's yet, ``packages`` are compiled into
    it in parallel (``precompile``). Returns the folder, or None where nothing was changed."""
    if os.environ.get("MEGABATCH_PYCACHE", "1") == "0":
        return None
    if sys.pycache_prefix is not None:  # set by the user, or inherited from a megabatch process (kept then)
        return Path(sys.pycache_prefix) if in_use() else None
    spec = importlib.util.find_spec(probe)  # found, not imported
    if spec is None or not spec.cached or os.path.exists(spec.cached):
        return None
    folder = bytecode_folder()
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = os.environ[_MARK] = str(folder)
    if not os.path.exists(importlib.util.cache_from_source(spec.origin)):  # cold: nothing of the probe's kept yet
        precompile(folder, packages)
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


def precompile(folder: Path, packages: tuple[str, ...], workers: int | None = None) -> list[subprocess.Popen]:
    """Compile ``packages``' modules into ``folder`` (``sys.pycache_prefix``) in ``workers`` background processes
    (one per core but this process's, at most 16), each given every ``workers``-th module of the list ordered
    shallow first (the package's own modules, which its import reads first), so that this process's imports,
    running meanwhile, find most of their bytecode written (Python writes each file whole, under a temporary name
    first). Only one process of a node compiles (a lock file in ``folder``, removed when the last of its workers
    ends); a process finding the lock starts none. Returns the workers started."""
    paths = [path for name in packages for path in _package_sources(name)]
    if not paths:
        return []
    workers = max(1, min(16, (os.cpu_count() or 2) - 1)) if workers is None else workers
    lock = folder / _LOCK
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            if time.time() - lock.stat().st_mtime < _LOCK_STALE_S:
                return []  # another process of this node is compiling
            lock.touch()
        started = []
        for index in range(workers):
            worker = subprocess.Popen([sys.executable, "-c", _COMPILE], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                      env={**os.environ, "PYTHONPYCACHEPREFIX": str(folder)}, text=True)
            worker.stdin.write("\n".join(paths[index::workers]))
            worker.stdin.close()
            started.append(worker)
    except OSError:
        return []
    global _precompilers
    _precompilers = started
    threading.Thread(target=_unlock_when_done, args=(started, lock), daemon=True, name="precompile").start()
    return started


_precompilers: list[subprocess.Popen] = []  # kept: they run on after this process if it ends first


def _unlock_when_done(workers: list[subprocess.Popen], lock: Path) -> None:
    for worker in workers:
        worker.wait()
    lock.unlink(missing_ok=True)


def _package_sources(name: str) -> list[str]:
    """The ``.py`` files of the installed package ``name`` (found, not imported), shallow first; none where it is
    not installed or is a single module."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        for directory, subdirectories, files in os.walk(root):
            subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
            found += [os.path.join(directory, file) for file in files if file.endswith(".py")]
    return sorted(found, key=lambda path: (path.count(os.sep), path))
