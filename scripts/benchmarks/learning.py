"""What a setting that is not exact does to learning: the same ``python train.py`` run (the default
digits run unless ``--set`` changes it) once per setting and seed, and each run's loss curve and
final zero-shot top-1, side by side with their means over the seeds.

    python scripts/benchmarks/learning.py --settings model.gelu=erf model.gelu=tanh --seeds 0,1,2 --out gelu.json
    python scripts/benchmarks/learning.py --settings model.fp8=false model.fp8=true \
        --set model.compile=true batch=256 trainer.sub_batch=64 --out fp8.json

Each run is a process of its own, ``python train.py <--set ...> <setting> seed=<seed>
name=learning_<setting>_s<seed>``, in ``runs/``; ``--reuse`` reads a run that already finished there
instead of training it again. Loss: the logged training loss at each logged step; ``loss_last_100``:
its mean over the last 100 steps' logs. Zero-shot: the last ``eval/*/top1`` the run logged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from megabatch.bench import ROOT, write_results


def run(setting: str, seed: int, overrides: list[str], reuse: bool) -> dict:
    name = "learning_" + "".join(c if c.isalnum() else "_" for c in setting) + f"_s{seed}"
    metrics = ROOT / "runs" / name / "metrics.jsonl"
    finished = metrics.exists() and any("/top1" in line for line in metrics.read_text().splitlines())
    if not (reuse and finished):
        command = [sys.executable, "train.py", *overrides, setting, f"seed={seed}", f"name={name}", "overwrite=true"]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    top1 = [value for row in rows for key, value in row.items() if key.startswith("eval/") and key.endswith("/top1")]
    last = max(losses)
    tail = [loss for step, loss in losses.items() if step > last - 100]
    return {"setting": setting, "seed": seed, "run": name, "loss": losses, "final_loss": losses[last],
            "loss_last_100": statistics.mean(tail), "zero_shot_top1": top1[-1] if top1 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", required=True, help="one override per variant compared")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", nargs="*", default=[], help="overrides every run shares")
    parser.add_argument("--reuse", action="store_true", help="read runs that already finished")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for setting in args.settings:
            results.append(run(setting, seed, args.set, args.reuse))
            write_results(args.out, results, shared=args.set)
    summary = []
    for setting in args.settings:
        mine = [row for row in results if row["setting"] == setting]
        top1 = [row["zero_shot_top1"] for row in mine if row["zero_shot_top1"] is not None]
        summary.append({"setting": setting, "seeds": len(mine),
                        "loss_last_100_mean": statistics.mean(row["loss_last_100"] for row in mine),
                        "zero_shot_top1_mean": statistics.mean(top1) if top1 else None,
                        "zero_shot_top1_each": top1})
        print(f"{setting:>24}: last-100-step loss {summary[-1]['loss_last_100_mean']:.4f}, zero-shot top-1 "
              f"{summary[-1]['zero_shot_top1_mean']:.2f}% ({', '.join(f'{t:.2f}' for t in top1)})", flush=True)
    write_results(args.out, results, shared=args.set, summary=summary)


if __name__ == "__main__":
    main()
