"""scripts/benchmarks: one entry point that lists every benchmark and runs one by name, and a README
table that names each of them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from .helpers import ROOT

FOLDER = ROOT / "scripts" / "benchmarks"


def runner():
    spec = importlib.util.spec_from_file_location("benchmarks_run", FOLDER / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runner_lists_every_benchmark_and_the_readme_table_names_them():
    module = runner()
    names = module.benchmarks()
    files = {path.stem for path in FOLDER.glob("*.py")} - module.NOT_BENCHMARKS
    assert set(names) == files and "end_to_end" in names
    assert all(summary for summary in names.values())  # each has a docstring
    table = (FOLDER / "README.md").read_text()
    assert [name for name in names if f"| `{name}` |" not in table] == []


def test_the_runner_runs_a_benchmark_by_name_and_refuses_an_unknown_one():
    ran = subprocess.run([sys.executable, str(FOLDER / "run.py"), "plot_memory", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "usage: plot_memory.py" in ran.stdout, ran.stderr
    unknown = subprocess.run([sys.executable, str(FOLDER / "run.py"), "nope"], capture_output=True, text=True,
                             timeout=60)
    assert unknown.returncode == 2 and "no benchmark 'nope'" in unknown.stderr
