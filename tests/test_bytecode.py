"""Bytecode kept in the cache directory where the packages have none and Python may not write it
(``megabatch/runtime/bytecode.py``), in fresh interpreters: a package installed without bytecode stands in
for torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

FIRST = """
import importlib.machinery  # as the second process does
import sys
from megabatch.runtime import bytecode
assert bytecode.use_kept_bytecode(probe="plainpkg", packages=()) == bytecode.bytecode_folder(), sys.pycache_prefix
import plainpkg.deep
assert plainpkg.deep.VALUE == 42
given = bytecode.write_missing_bytecode()
assert given >= 2, given
assert bytecode._compiler.wait(timeout=60) == 0
"""

SECOND = """
import importlib.machinery
from megabatch.runtime import bytecode
assert bytecode.use_kept_bytecode(probe="plainpkg") == bytecode.bytecode_folder()

def from_source(*args, **kwargs):
    raise AssertionError("compiled from source")

importlib.machinery.SourceFileLoader.source_to_code = from_source  # the kept bytecode must serve
import plainpkg.deep
print(plainpkg.deep.__cached__)
assert bytecode.write_missing_bytecode() == 0  # nothing is missing now
"""

STATE = "from megabatch.runtime import bytecode; print(bytecode.use_kept_bytecode(probe='plainpkg'), bytecode.in_use())"


def python(code: str, env: dict) -> str:
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return ran.stdout


def test_bytecode_is_kept_in_the_cache_directory_when_python_may_not_write_it(tmp_path):
    package = tmp_path / "site" / "plainpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "deep.py").write_text("VALUE = 42\n")
    cache = tmp_path / "cache"
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "MEGABATCH_CACHE": str(cache), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(src)])}
    env.pop("PYTHONPYCACHEPREFIX", None)
    python(FIRST, env)
    assert not list(package.rglob("*.pyc"))  # nothing beside the sources
    kept = cache / "pycache" / str(package / "deep.py").lstrip(os.sep)
    assert list(kept.parent.glob("deep.*.pyc")), sorted(cache.rglob("*"))
    assert python(SECOND, env).strip().startswith(str(cache / "pycache"))
    # a process started by a megabatch process (the prefix in its environment) keeps its folder,
    # whatever its own cache directory
    inherited = python(STATE, env | {"MEGABATCH_CACHE": str(tmp_path / "other"),
                                     "PYTHONPYCACHEPREFIX": str(cache / "pycache"),
                                     "MEGABATCH_PYCACHE_FOLDER": str(cache / "pycache")})
    assert inherited.split() == [str(cache / "pycache"), "True"]
    users = env | {"PYTHONPYCACHEPREFIX": str(tmp_path / "users")}  # a prefix of the user's own: left alone
    assert python(STATE, users).split() == ["None", "False"]
    # off, or where the package has bytecode beside it: nothing changes
    assert python(STATE, env | {"MEGABATCH_PYCACHE": "0"}).split() == ["None", "False"]
    python(f"import compileall; compileall.compile_dir({str(package)!r}, quiet=1)", env)
    assert python(STATE, env).split() == ["None", "False"]


PRECOMPILE = """
import os, sys
from megabatch.runtime import bytecode
assert bytecode.use_kept_bytecode(probe="plainpkg", packages=("plainpkg", "notinstalled")) == bytecode.bytecode_folder()
workers = bytecode._precompilers
assert len(workers) == min(16, max(1, (os.cpu_count() or 2) - 1)), workers
assert all(worker.wait(timeout=60) == 0 for worker in workers)
print(sys.pycache_prefix)
"""

FROM_KEPT = SECOND.split("assert bytecode.write_missing_bytecode()")[0]  # the package's modules come from the folder


def test_a_cold_folder_is_filled_in_parallel_while_the_process_imports(tmp_path):
    package = tmp_path / "site" / "plainpkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "deep.py", "sub/__init__.py", "sub/deeper.py"):
        (package / name).write_text("VALUE = 42\n")
    cache = tmp_path / "cache"
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "MEGABATCH_CACHE": str(cache), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(src)])}
    env.pop("PYTHONPYCACHEPREFIX", None)
    folder = Path(python(PRECOMPILE, env).strip())
    assert folder == cache / "pycache"
    kept = sorted(path.relative_to(folder).as_posix().split("plainpkg/", 1)[1]
                  for path in folder.rglob("*.pyc") if "plainpkg" in str(path))
    assert [name.split(".")[0] for name in kept] == ["__init__", "deep", "sub/__init__", "sub/deeper"], kept
    for _ in range(100):  # the lock goes with the last worker (a thread of the process waits for them)
        if not (folder / ".precompiling").exists():
            break
        time.sleep(0.1)
    assert not (folder / ".precompiling").exists()
    # the modules are read from there now: nothing is compiled from source
    assert python(FROM_KEPT, env).strip().startswith(str(folder))


def test_one_process_of_a_node_precompiles(tmp_path):
    from megabatch.runtime import bytecode

    package = tmp_path / "site" / "plainpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    folder = tmp_path / "pycache"
    folder.mkdir()
    (folder / ".precompiling").touch()  # another process of this node is compiling
    sys.path.insert(0, str(tmp_path / "site"))
    try:
        assert bytecode.precompile(folder, ("plainpkg",)) == []
        stale = time.time() - 2 * bytecode._LOCK_STALE_S  # ... unless its lock is stale (that process died)
        os.utime(folder / ".precompiling", (stale, stale))
        workers = bytecode.precompile(folder, ("plainpkg",), workers=2)
        assert len(workers) == 2 and all(worker.wait(timeout=60) == 0 for worker in workers)
        assert bytecode.precompile(folder, ("missing_package",)) == []  # nothing to compile: no workers
    finally:
        sys.path.remove(str(tmp_path / "site"))
