"""The one entry point of megabatch's benchmarks: ``run.py`` lists them, ``run.py NAME [options]`` runs
``scripts/benchmarks/NAME.py`` with those options (``run.py NAME --help``: its own).

    python scripts/benchmarks/run.py
    python scripts/benchmarks/run.py end_to_end --model vit_b16 --batch 4k --sub-batch 512 --modes false \\
        --openclip --set data.decode=gpu model.compile=true --out vit_b16_4k.json

Each writes one JSON (``bench.write_results``: command, git commit, GPU, versions,
results); ``scripts/benchmarks/README.md`` says what each measures and which ``docs/bench`` files
it wrote.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"run", "bench", "processes", "sample_stacks"}  # this runner, and the helpers the benchmarks share


def benchmarks() -> dict[str, str]:
    """``{name: the first sentence of its docstring}`` of every benchmark beside this file."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem not in NOT_BENCHMARKS:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            sentence = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].replace("``", "")
            found[path.stem] = sentence if len(sentence) <= 100 else sentence[:97] + "..."
    return found


def main(argv: list[str]) -> int:
    names = benchmarks()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python scripts/benchmarks/run.py NAME [options]   (NAME --help: its options)\n")
        width = max(map(len, names))
        for name, summary in names.items():
            print(f"  {name:<{width}}  {summary}")
        return 0
    name = argv[0].removesuffix(".py")
    if name not in names:
        print(f"no benchmark {name!r}; there are: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [str(HERE / f"{name}.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
