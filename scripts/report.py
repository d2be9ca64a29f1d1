"""Put runs side by side: one table and one picture for a sweep, finished or in progress; and checkpoints'
evaluation tables side by side.

    python scripts/report.py runs/<sweep>                 # its jobs -> runs/<sweep>/summary.{csv,md,png}
    python scripts/report.py runs/a runs/b --out cmp/     # any run or sweep directories together
    python scripts/report.py runs/a/checkpoints/last.pt runs/b/checkpoints/step_5000.pt --out cmp/

Prints the tables (Markdown). A run or sweep's summary ends with its runs' last checkpoints' evaluations side
by side (results.{md,csv}); checkpoints (or their ``.results.json``, written by training's last evaluation and by
``scripts/evaluate.py``) give that table alone: a row per set and its main metric, a column per checkpoint, the
average. A multirun writes the same files by itself when it ends.
"""

import argparse
import sys
from pathlib import Path

from megabatch.report import find_runs, write_summary
from megabatch.report.results import read_results, results_path, write_side_by_side


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="sweep directories (runs/<sweep>) or run directories; "
                        "or checkpoints (or their .results.json) to put their evaluations side by side")
    parser.add_argument("--out", type=Path, help="where to write summary.{csv,md,png} or results.{csv,md} (default: "
                        "the one directory given, or the checkpoint's; required for several)")
    parser.add_argument("--title", help="the title of the table and the picture (default: the output folder's name)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None and len(args.paths) > 1:
        parser.error("several paths: say where the summary goes with --out DIR")
    files = [path for path in args.paths if not path.is_dir()]
    if files:  # checkpoints or their results files: their evaluation tables side by side
        if len(files) != len(args.paths):
            parser.error("give run or sweep directories, or checkpoints (results files), not both")
        tables = {}
        for path in files:
            found = results_path(path)
            if found is None:
                parser.error(f"{path}: no results table beside it (<ckpt>.results.json: run scripts/evaluate.py "
                             f"ckpt={path} eval=... first)")
            tables[label_of(path, files)] = read_results(found)
        out = args.out or files[0].parent
        print(write_side_by_side(tables, out), flush=True)
        print(f"{len(tables)} checkpoints -> {out}/results.md, results.csv", file=sys.stderr)
        return 0
    try:
        runs = find_runs(args.paths)
    except FileNotFoundError as error:
        parser.error(str(error))
    if not runs:
        parser.error(f"no runs in {', '.join(map(str, args.paths))} (a run directory holds metrics.jsonl)")
    out = args.out or args.paths[0]
    print(write_summary(args.paths, out, args.title), end="", flush=True)
    print(f"{len(runs)} runs -> {out}/summary.md, summary.csv, summary.png", file=sys.stderr)
    return 0


def label_of(path: Path, paths: list[Path]) -> str:
    """A checkpoint's column: its file's name, with its run's where names repeat (runs/a/.../last.pt)."""
    stem = path.name.split(".results.")[0].removesuffix(".pt")
    if sum(p.name.split(".results.")[0].removesuffix(".pt") == stem for p in paths) == 1:
        return stem
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return f"{run.name}/{stem}"


if __name__ == "__main__":
    sys.exit(main())
