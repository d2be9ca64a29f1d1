"""Put runs side by side: one table and one picture for a sweep, finished or in progress.

    python scripts/report.py runs/<sweep>                 # its jobs -> runs/<sweep>/summary.{csv,md,png}
    python scripts/report.py runs/a runs/b --out cmp/     # any run or sweep directories together

Prints the table (Markdown). A multirun writes the same files by itself when it ends.
"""

import argparse
import sys
from pathlib import Path

from megabatch.report import find_runs, write_summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="sweep directories (runs/<sweep>) or run directories")
    parser.add_argument("--out", type=Path, help="where to write summary.{csv,md,png} (default: the one "
                        "directory given; required for several)")
    parser.add_argument("--title", help="the title of the table and the picture (default: the output folder's name)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None and len(args.paths) > 1:
        parser.error("several directories: say where the summary goes with --out DIR")
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


if __name__ == "__main__":
    sys.exit(main())
