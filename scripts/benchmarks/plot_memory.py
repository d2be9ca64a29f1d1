"""Plot loss memory (and time) against batch size from benchmarks/loss.py JSON files, like Figure 1 of
the Inf-CL paper: python scripts/benchmarks/plot_memory.py loss1.json loss2.json --out memory.png"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("inputs", nargs="+", help="benchmarks/loss.py JSON files")
    parser.add_argument("--out", default="memory.png")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--dim", type=int, default=768)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(list)
    gpu = set()
    for path in args.inputs:
        data = json.load(open(path))
        gpu.add(data["meta"]["gpu"])
        for row in data["results"]:
            if row.get("status") == "ok" and row.get("dtype") == args.dtype \
                    and row.get("dim", args.dim) == args.dim:
                key = f"{row['backend']} ({row['gpus']} GPU{'s' if row['gpus'] > 1 else ''})"
                series[key].append((row["batch"], row["extra_gb"], row["time_s"]))
    figure, (memory_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.cm.tab20.colors
    for index, (key, points) in enumerate(sorted(series.items())):
        points.sort()
        batches = [p[0] / 1024 for p in points]
        style = "--" if key.startswith("ref_") else "-"
        color = colors[index % len(colors)]
        memory_ax.plot(batches, [p[1] for p in points], style, marker="o", label=key, color=color)
        time_ax.plot(batches, [p[2] for p in points], style, marker="o", label=key, color=color)
    for axis, label in ((memory_ax, "extra memory per GPU (GB)"), (time_ax, "forward + backward (s)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("global batch (k samples)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
    memory_ax.legend(fontsize=7)
    figure.suptitle(f"Contrastive loss, {args.dtype} features, c = {args.dim}, {', '.join(sorted(gpu))}")
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
