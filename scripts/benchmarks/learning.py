"""What a setting that is not exact does to learning: the same ``python train.py`` run (the default
digits run unless ``--set`` changes it) once per setting and seed, and each run's loss curve and
final zero-shot top-1, side by side with their means over the seeds, and each later setting's metrics less the first
setting's, paired by seed, with a 95% interval (``against_first`` in the summary; ``megabatch/report/seeds.py``).

    python scripts/benchmarks/learning.py --settings model.gelu=erf model.gelu=tanh --seeds 0,1,2 --out gelu.json
    python scripts/benchmarks/learning.py --settings model.fp8=false model.fp8=true \
        --set model.compile=true batch=256 trainer.sub_batch=64 --out fp8.json

``--linear-probe``: each run's last checkpoint also goes through ``scripts/evaluate.py eval=digits_probe`` (the frozen
image tower's features, a logistic-regression probe), reported as ``linear_probe_top1`` beside the zero-shot top-1.

``--dense-probe``: the same through ``eval=digits_dense`` (the frozen tower's patch tokens, scenes of 2 x 2 digits),
reported as ``dense_miou`` and ``dense_top1``.

``--caption-accuracy`` (a CoCa, ``--set model=tiny_coca``): each run's last checkpoint also captions the held-out
digits with ``scripts/caption.py`` (beam search), and the run reports the share of captions that name the scan's
digit, as a word or a numeral, and no other digit (``caption_accuracy``).

    python scripts/benchmarks/learning.py --set model=tiny_coca --settings loss.caption_weight=0 \
        loss.caption_weight=2.0 --caption-accuracy --out coca_digits.json

``--aspects`` (a NaFlex tower against a fixed-size one): every run trains on the digits' training split written
again with each scan padded (black, as the scans' background) to the next of these width / height ratios, cycled;
the held-out digits stay square. ``--place random``: each scan at a random place on its canvas (a fixed-size tower's
centre crop may miss it); ``--aspect-test``: the held-out scans padded alike, and the zero-shot top-1 read on them.

    python scripts/benchmarks/learning.py --settings model=tiny model=tiny_naflex --aspects 0.5 1 2 3 \
        --out naflex_digits.json
    python scripts/benchmarks/learning.py --settings model=tiny model=tiny_naflex --aspects 0.5 1 2 3 \
        --place random --aspect-test --out naflex_digits_placed.json

A setting of several overrides is one quoted argument (``'model.decoder.layers=2 loss.caption_weight=1'``);
``--parallel N`` trains N runs at once (a GPU machine's spare cores), each with the machine's cores / N threads
(``OMP_NUM_THREADS``, unless given: on 2 cores a plain digits run beside another took 13 minutes with two
threads each, one minute with one). Each run is a process of its own,
``python train.py <--set ...> <setting> seed=<seed>
name=learning_<setting>_s<seed>``, in ``runs/``; ``--reuse`` reads a run that already finished there
instead of training it again. Loss: the logged training loss at each logged step; ``loss_last_100``:
its mean over the last 100 steps' logs. Zero-shot: the last ``eval/*/top1`` the run logged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from bench import ROOT, write_results

ENV = dict(os.environ)  # each run's and evaluation's environment: main() gives it their share of the cores


def threads_each(parallel: int, cores: int | None = None, given: str | None = None) -> str:
    """``OMP_NUM_THREADS`` for each of ``parallel`` runs at once: the one ``given``, else the cores shared out (torch
    takes every core in each process otherwise: on 2 cores two runs of two threads each spun against each other, a
    plain digits run 13 times slower than beside another of one thread)."""
    return given or str(max(1, (cores or os.cpu_count() or 1) // parallel))


def named_digits(caption: str) -> set[int]:
    """The digits a caption names, as words (``seven``) or numerals (``7``)."""
    from megabatch.data.digits import CLASS_NAMES

    words = re.findall(r"[a-z]+|\d+", caption.lower())
    return {d for d, name in enumerate(CLASS_NAMES) if name in words or str(d) in words}


def caption_accuracy(run_dir: Path) -> dict:
    """``scripts/caption.py`` on the held-out digits with ``run_dir``'s last checkpoint: the share of captions
    naming exactly the scan's digit, and a few examples."""
    import tarfile

    from megabatch.data.digits import ensure_digits
    from megabatch.data.urls import expand_urls

    test = ensure_digits(os.environ.get("MEGABATCH_CACHE", "~/.cache/megabatch"))["test"]
    out = run_dir / "captions.jsonl"
    command = [sys.executable, "scripts/caption.py", f"ckpt={run_dir / 'checkpoints' / 'last.pt'}", f"images={test}",
               f"out={out}", "batch=256"]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=ENV)
    labels = {}
    for url in expand_urls(test, "digits"):
        with tarfile.open(url) as tar:
            for member in tar.getmembers():
                key, _, ext = Path(member.name).name.partition(".")
                if ext == "json":
                    labels[f"{Path(url).name}/{key}"] = json.loads(tar.extractfile(member).read())["label"]
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    right = sum(named_digits(row["caption"]) == {labels[row["image"]]} for row in rows)
    return {"caption_accuracy": 100.0 * right / len(rows), "captions": len(rows),
            "caption_examples": [{"digit": labels[row["image"]], "caption": row["caption"]} for row in rows[:5]]}


def linear_probe(run_dir: Path, eval_set: str = "digits_probe") -> dict:
    """``scripts/evaluate.py eval=digits_probe`` on ``run_dir``'s last checkpoint: the probe's held-out top-1; with
    ``eval_set="digits_dense"`` the dense probe's mean IoU and patch accuracy."""
    out = run_dir / f"{eval_set}.json"
    command = [sys.executable, "scripts/evaluate.py", f"ckpt={run_dir / 'checkpoints' / 'last.pt'}",
               f"eval={eval_set}", f"output={out}", "features=null"]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=ENV)
    result = json.loads(out.read_text())
    if eval_set == "digits_dense":
        return {"dense_miou": result["dense_miou"], "dense_top1": result["dense_top1"]}
    return {"linear_probe_top1": result["lp_top1"]}


def run(setting: str, seed: int, overrides: list[str], reuse: bool, captions: bool = False,
        probe: bool = False, dense: bool = False) -> dict:
    name = "learning_" + "".join(c if c.isalnum() else "_" for c in setting) + f"_s{seed}"
    metrics = ROOT / "runs" / name / "metrics.jsonl"
    status = metrics.parent / "status.json"  # a run stopped part way (a signal: its last.pt) is trained again
    finished = status.exists() and json.loads(status.read_text()).get("status") == "completed"
    if not (reuse and finished):
        command = [sys.executable, "train.py", *overrides, *setting.split(), f"seed={seed}", f"name={name}",
                   "overwrite=true"]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=ENV)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    top1 = [value for row in rows for key, value in row.items() if key.startswith("eval/") and key.endswith("/top1")]
    last = max(losses)
    tail = [loss for step, loss in losses.items() if step > last - 100]
    result = {"setting": setting, "seed": seed, "run": name, "loss": losses, "final_loss": losses[last],
              "loss_last_100": statistics.mean(tail), "zero_shot_top1": top1[-1] if top1 else None}
    return {**result, **(caption_accuracy(metrics.parent) if captions else {}),
            **(linear_probe(metrics.parent) if probe else {}),
            **(linear_probe(metrics.parent, "digits_dense") if dense else {})}


def aspect_digits(aspects: list[float], folder: Path, split: str = "train", place: str = "centre") -> str:
    """The digits' ``split`` shards written again under ``folder``, each scan padded (black) to the next of ``aspects``
    (width / height), cycled, ``place``: centred, or at a random place along the longer side (drawn from the scan's
    index: the same on every call); returns their brace pattern (written once)."""
    import io
    import random
    import tarfile

    import numpy as np
    from PIL import Image

    from megabatch.data.digits import ensure_digits
    from megabatch.data.shard_writer import Sample, encode_png, write_shards
    from megabatch.data.urls import expand_urls

    done = folder / f"{split}-pattern.txt"
    if done.exists():
        return done.read_text()
    samples, index = [], 0
    for url in expand_urls(ensure_digits(os.environ.get("MEGABATCH_CACHE", "~/.cache/megabatch"))[split], "digits"):
        with tarfile.open(url) as tar:
            members: dict[str, dict[str, bytes]] = {}
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(member).read()
        for key in sorted(members):
            fields = members[key]
            scan = np.asarray(Image.open(io.BytesIO(fields["png"])).convert("RGB"))
            aspect = aspects[index % len(aspects)]
            index += 1
            height, width = scan.shape[:2]
            new_h, new_w = (height, round(height * aspect)) if aspect >= 1 else (round(width / aspect), width)
            canvas = np.zeros((new_h, new_w, 3), dtype=np.uint8)
            top, left = (new_h - height) // 2, (new_w - width) // 2
            if place == "random":
                draw = random.Random(index)
                top, left = draw.randint(0, new_h - height), draw.randint(0, new_w - width)
            canvas[top:top + height, left:left + width] = scan
            meta = json.loads(fields["json"]) if "json" in fields else {}
            samples.append(Sample(encode_png(canvas), "png", fields["txt"].decode(), meta))
    shards = write_shards(samples, folder, split, per_shard=500)
    pattern = f"{folder}/{split}-{{000000..{len(shards) - 1:06d}}}.tar"
    done.write_text(pattern)
    return pattern


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", required=True,
                        help="one variant compared per argument: an override, or several in one quoted argument")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", nargs="*", default=[], help="overrides every run shares")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs trained at once (a GPU machine's spare cores and memory); 1: one after another")
    parser.add_argument("--reuse", action="store_true", help="read runs that already finished")
    parser.add_argument("--caption-accuracy", action="store_true",
                        help="a CoCa's captions of the held-out digits: the share naming the right digit")
    parser.add_argument("--dense-probe", action="store_true",
                        help="each run's last checkpoint also through scripts/evaluate.py eval=digits_dense (the "
                             "frozen tower's patch tokens: mean IoU of scenes of 2 x 2 digits)")
    parser.add_argument("--linear-probe", action="store_true",
                        help="each run's last checkpoint through scripts/evaluate.py eval=digits_probe")
    parser.add_argument("--aspects", type=float, nargs="+", default=None,
                        help="the training scans padded to these width / height ratios, cycled (NaFlex)")
    parser.add_argument("--place", choices=("centre", "random"), default="centre",
                        help="with --aspects: each scan centred on its canvas, or at a random place")
    parser.add_argument("--aspect-test", action="store_true",
                        help="with --aspects: the held-out scans padded alike, and the zero-shot top-1 read on them")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.aspects:
        folder = ROOT / "runs" / (f"digits-aspects-{'-'.join(f'{a:g}' for a in args.aspects)}"
                                  f"{'-random' if args.place == 'random' else ''}")
        # data=digits' settings
        args.set = [*args.set, f"data.train.urls={aspect_digits(args.aspects, folder, 'train', args.place)}"]
        if args.aspect_test:
            args.set.append(f"eval.digits.urls={aspect_digits(args.aspects, folder, 'test', args.place)}")
    runs = [(setting, int(seed)) for seed in args.seeds.split(",") for setting in args.settings]
    ENV["OMP_NUM_THREADS"] = threads_each(args.parallel, given=os.environ.get("OMP_NUM_THREADS"))
    results = []
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # each run is a process of its own
        futures = [pool.submit(run, setting, seed, args.set, args.reuse, args.caption_accuracy, args.linear_probe,
                               args.dense_probe) for setting, seed in runs]
        for future in as_completed(futures):
            results.append(future.result())
            write_results(args.out, sorted(results, key=lambda row: runs.index((row["setting"], row["seed"]))),
                          shared=args.set)
    results.sort(key=lambda row: runs.index((row["setting"], row["seed"])))
    summary = []
    for setting in args.settings:
        mine = [row for row in results if row["setting"] == setting]
        top1 = [row["zero_shot_top1"] for row in mine if row["zero_shot_top1"] is not None]
        summary.append({"setting": setting, "seeds": len(mine),
                        "loss_last_100_mean": statistics.mean(row["loss_last_100"] for row in mine),
                        "zero_shot_top1_mean": statistics.mean(top1) if top1 else None,
                        "zero_shot_top1_each": top1})
        if args.linear_probe:
            summary[-1]["linear_probe_top1_each"] = [row["linear_probe_top1"] for row in mine]
            summary[-1]["linear_probe_top1_mean"] = statistics.mean(summary[-1]["linear_probe_top1_each"])
            print(f"{setting:>24}: linear probe top-1 {summary[-1]['linear_probe_top1_mean']:.2f}% "
                  f"({', '.join(f'{a:.2f}' for a in summary[-1]['linear_probe_top1_each'])})", flush=True)
        if args.dense_probe:
            for key in ("dense_miou", "dense_top1"):
                summary[-1][f"{key}_each"] = [row[key] for row in mine]
                summary[-1][f"{key}_mean"] = statistics.mean(summary[-1][f"{key}_each"])
            print(f"{setting:>24}: dense probe mean IoU {summary[-1]['dense_miou_mean']:.2f}% "
                  f"({', '.join(f'{a:.2f}' for a in summary[-1]['dense_miou_each'])})", flush=True)
        if args.caption_accuracy:
            summary[-1]["caption_accuracy_each"] = [row["caption_accuracy"] for row in mine]
            summary[-1]["caption_accuracy_mean"] = statistics.mean(summary[-1]["caption_accuracy_each"])
            print(f"{setting:>24}: digit named in {summary[-1]['caption_accuracy_mean']:.2f}% of the captions "
                  f"({', '.join(f'{a:.2f}' for a in summary[-1]['caption_accuracy_each'])})", flush=True)
        print(f"{setting:>24}: last-100-step loss {summary[-1]['loss_last_100_mean']:.4f}, zero-shot top-1 "
              f"{summary[-1]['zero_shot_top1_mean']:.2f}% ({', '.join(f'{t:.2f}' for t in top1)})", flush=True)
        if setting != args.settings[0]:
            summary[-1]["against_first"] = against(results, args.settings[0], setting)
            print(f"{setting:>24}: against {args.settings[0]}, paired by seed (mean, 95% interval): " + "; ".join(
                f"{key} {value['mean']:+.2f}" + (f" +- {value['half_width']:.2f}" if value["half_width"] else "")
                for key, value in summary[-1]["against_first"].items()), flush=True)
    write_results(args.out, results, shared=args.set, summary=summary)


def against(results: list[dict], first: str, setting: str) -> dict:
    """Each measured metric of ``setting`` less the first setting's, paired by seed (``report/seeds.py``): the mean
    difference, its 95% interval's half width and the seeds both have."""
    from megabatch.report.seeds import METRICS, by_seed, paired_difference

    compared = {}
    for key in METRICS:
        paired = paired_difference(by_seed(results, first, key), by_seed(results, setting, key))
        if paired is not None:  # one seed: no interval (null, not JSON's non-standard NaN)
            compared[key] = {**paired._asdict(), "half_width": None if paired.seeds < 2 else paired.half_width}
    return compared


if __name__ == "__main__":
    main()
