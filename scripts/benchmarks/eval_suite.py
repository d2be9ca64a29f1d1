"""A suite of evaluations on one checkpoint, by one GPU and by several under torchrun, as users run them:
``scripts/evaluate.py`` and ``torchrun --nproc_per_node=N scripts/evaluate.py`` on the same sets, the time of each
set and whether the numbers agree; then the linear probe again, reading the features the first run kept.

    python scripts/benchmarks/eval_suite.py --gpus 2,4 --out eval_suite.json

The sets are real scans (scikit-learn's handwritten digits, jittered on a 64 px canvas), written in
CLIP_benchmark's layouts: zero-shot classification (with a training split: the linear probe's), a multi-label set
(two digits an image, mAP), retrieval with five captions an image, and SugarCrepe-style selection (the true
caption against one naming another digit). The checkpoint: ``train.py model=openclip model.arch=<arch>`` for
``--train-steps`` steps on the embedded digits (or ``--ckpt``). JSON: per run, its wall time, each set's seconds
and numbers; per set, the largest difference between the runs' numbers.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench import ROOT, write_results

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def canvas(rng, scans, digits: list[int], labels) -> np.ndarray:
    """A 64 px grey image with the given digits' scans (8x8, upscaled) at jittered places."""
    from PIL import Image

    image = rng.integers(0, 40, (64, 64), dtype=np.uint8)
    size = 48 if len(digits) == 1 else 30
    for slot, digit in enumerate(digits):
        pool = np.flatnonzero(labels == digit)
        scan = scans[rng.choice(pool)]
        tile = np.asarray(Image.fromarray((scan * 255 / 16).astype(np.uint8)).resize((size, size), Image.BILINEAR))
        y = rng.integers(0, 64 - size + 1) if len(digits) == 1 else 2 + 32 * slot
        x = rng.integers(0, 64 - size + 1) if len(digits) == 1 else 2 + 32 * slot
        image[y:y + size, x:x + size] = np.maximum(image[y:y + size, x:x + size], tile)
    return np.repeat(image[..., None], 3, axis=2)


def build_sets(workdir: Path, sizes: dict) -> Path:
    """The four sets under ``workdir``/sets and a config folder naming them (``eval=bench_suite``)."""
    from sklearn.datasets import load_digits

    from megabatch.data.digits import CAPTION_PHRASINGS, EVAL_TEMPLATES
    from megabatch.data.shard_writer import encode_png
    from megabatch.eval.clip_benchmark import write_folder

    sets, rng = workdir / "sets", np.random.default_rng(0)
    digits = load_digits()
    scans, labels = digits.images, digits.target
    classnames = "\n".join(WORDS) + "\n"
    templates = "\n".join(t.replace("{}", "{c}") for t in EVAL_TEMPLATES) + "\n"
    for split, count in (("train", sizes["probe_train"]), ("test", sizes["classification"])):
        rows = [(int(d), canvas(rng, scans, [int(d)], labels)) for d in rng.integers(0, 10, count)]
        write_folder(sets / "digits", split, [{"png": encode_png(img), "cls": d} for d, img in rows],
                     classnames=classnames, zeroshot_classification_templates=templates)
    multi = []
    for _ in range(sizes["multilabel"]):
        pair = [int(d) for d in rng.choice(10, 2, replace=False)]
        vector = np.zeros(10, dtype=np.int64)
        vector[pair] = 1
        buffer = io.BytesIO()
        np.save(buffer, vector)
        multi.append({"png": encode_png(canvas(rng, scans, pair, labels)), "npy": buffer.getvalue()})
    write_folder(sets / "pairs", "test", multi, classnames=classnames, zeroshot_classification_templates=templates,
                 dataset_type="multilabel\n")
    pairs = []
    for d in rng.integers(0, 10, sizes["retrieval"]):
        texts = [p.format(word=WORDS[d], num=int(d)) for p in rng.choice(CAPTION_PHRASINGS, 5, replace=False)]
        pairs.append({"png": encode_png(canvas(rng, scans, [int(d)], labels)), "txt": "\n".join(texts)})
    write_folder(sets / "captions", "test", pairs, dataset_type="retrieval\n")
    (sets / "selection").mkdir(parents=True, exist_ok=True)
    lines = []
    for index, d in enumerate(rng.integers(0, 10, sizes["selection"])):
        other = int((d + rng.integers(1, 10)) % 10)
        path = sets / "selection" / f"{index}.png"
        path.write_bytes(encode_png(canvas(rng, scans, [int(d)], labels)))
        lines.append(json.dumps({"image": path.name, "captions": [f"a handwritten digit {WORDS[d]}",
                                                                 f"a handwritten digit {WORDS[other]}"],
                                 "subset": "replace_obj" if index % 2 else "replace_att"}))
    (sets / "selection" / "set.jsonl").write_text("\n".join(lines) + "\n")
    config = workdir / "configs" / "eval"
    config.mkdir(parents=True, exist_ok=True)
    (config / "bench_suite.yaml").write_text(f"""# @package eval
defaults:
  - clip_benchmark@digits_zeroshot
  - clip_benchmark@digit_pairs
  - retrieval@digit_captions
  - sugarcrepe@digit_selection
  - clip_benchmark@digits_probe
  - _self_

digits_zeroshot: {{name: digits_zeroshot, root: {sets / 'digits'}, batch_size: 256, num_workers: 8}}
digit_pairs: {{name: digit_pairs, root: {sets / 'pairs'}, batch_size: 256}}
digit_captions: {{name: digit_captions, format: clip_benchmark, root: {sets / 'captions'}, batch_size: 256}}
digit_selection: {{name: digit_selection, jsonl: {sets / 'selection' / 'set.jsonl'}, batch_size: 128}}
digits_probe: {{name: digits_probe, task: linear_probe, root: {sets / 'digits'}, batch_size: 256}}
""")
    return workdir / "configs"


def checkpoint(workdir: Path, arch: str, steps: int, lr: float, timeout_s: float) -> tuple[Path, dict]:
    """A checkpoint trained on the embedded digits, and its first and last logged losses (whether it learnt)."""
    run_dir = workdir / "run"
    command = [sys.executable, "train.py", "model=openclip", f"model.arch={arch}", "batch=256",
               f"trainer.max_steps={steps}", f"optim.lr={lr}", f"sched.warmup_steps={max(1, steps // 10)}",
               "trainer.log_every=10", "eval=none", f"run_dir={run_dir}", "overwrite=true"]
    print("$", " ".join(command[1:]), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    losses = [row["loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in row]
    training = {"command": " ".join(command[1:]), "seconds": round(time.perf_counter() - started, 1),
                "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}
    print(json.dumps(training), flush=True)
    return run_dir / "checkpoints" / "last.pt", training


def evaluate(gpus: int, ckpt: Path, configs: Path, features: Path, out: Path, timeout_s: float,
             leave_out: tuple[str, ...] = ()) -> dict:
    """``scripts/evaluate.py`` (under torchrun for several GPUs) on the suite: wall time, each set's numbers."""
    launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc_per_node={gpus}"]
    command = [*launcher, "scripts/evaluate.py", f"ckpt={ckpt}", "eval=bench_suite", *leave_out,
               f"features={features}", f"output={out}", f"hydra.searchpath=[file://{configs}]"]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        out = (error.stdout or b"").decode() + (error.stderr or b"").decode()
        return {"gpus": gpus, "command": " ".join(command), "returncode": "timeout", "wall_s": timeout_s,
                "log_tail": out[-4000:]}
    row = {"gpus": gpus, "command": " ".join(command), "returncode": done.returncode,
           "wall_s": round(time.perf_counter() - started, 1), "log": [line for line in done.stdout.splitlines()
                                                                      if " probe " in line or "evaluating" in line]}
    if done.returncode != 0:
        row["log_tail"] = (done.stdout + done.stderr)[-4000:]
        return row
    results = json.loads(out.read_text())
    results = results if all(isinstance(v, dict) for v in results.values()) else {"digits_probe": results}
    row["sets"] = {name: {k: v for k, v in result.items() if k not in ("ckpt", "step", "weights")}
                   for name, result in results.items()}
    return row


def evaluate_probe(gpus: int, ckpt: Path, configs: Path, features: Path, out: Path, timeout_s: float) -> dict:
    """The probe alone again (the suite's other sets left out), reading the features its first run kept."""
    return evaluate(gpus, ckpt, configs, features, out, timeout_s, ("~eval.digits_zeroshot", "~eval.digit_pairs",
                                                                     "~eval.digit_captions", "~eval.digit_selection"))


def agreement(one: dict, other: dict) -> dict:
    """Per set, the largest absolute difference between two runs' numbers (in the metrics' units, %)."""
    return {name: max((abs(value - other["sets"][name][metric]) for metric, value in result.items()
                       if metric not in ("seconds", "features_cached") and isinstance(value, (int, float))),
                      default=0.0)
            for name, result in one.get("sets", {}).items() if name in other.get("sets", {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="2", help="the torchrun runs' GPU counts, comma-separated (beside one GPU)")
    parser.add_argument("--arch", default="ViT-B-16")
    parser.add_argument("--train-steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=5e-4, help="the checkpoint's peak lr (warmup: a tenth)")
    parser.add_argument("--ckpt", help="a checkpoint to evaluate instead of training one")
    parser.add_argument("--classification", type=int, default=5000, help="zero-shot test images")
    parser.add_argument("--probe-train", type=int, default=10000, help="the probe's training images")
    parser.add_argument("--multilabel", type=int, default=2000)
    parser.add_argument("--retrieval", type=int, default=2000, help="images (five captions each)")
    parser.add_argument("--selection", type=int, default=1000)
    parser.add_argument("--timeout-s", type=float, default=300, help="per evaluate.py run")
    parser.add_argument("--workdir", default="/tmp/eval-suite-bench")
    parser.add_argument("--reuse", action="store_true", help="the sets and checkpoint already in --workdir")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    started = time.perf_counter()
    reuse = args.reuse and (workdir / "configs" / "eval" / "bench_suite.yaml").is_file()
    sizes = {"classification": args.classification, "probe_train": args.probe_train, "multilabel": args.multilabel,
             "retrieval": args.retrieval, "selection": args.selection}
    configs = workdir / "configs" if reuse else build_sets(workdir, sizes)
    built = time.perf_counter()
    kept = workdir / "run" / "checkpoints" / "last.pt"
    training = None
    if args.ckpt or (reuse and kept.is_file()):
        ckpt = Path(args.ckpt) if args.ckpt else kept
    else:
        ckpt, training = checkpoint(workdir, args.arch, args.train_steps, args.lr, 600)
    print(f"sets built in {built - started:.0f} s, checkpoint in {time.perf_counter() - built:.0f} s", flush=True)
    counts = [1, *(int(g) for g in str(args.gpus).split(",") if int(g) > 1)]
    meta = {"arch": args.arch, "gpus": counts[-1], "train_steps": args.train_steps, "training": training, "sizes": {
        k: getattr(args, k) for k in ("classification", "probe_train", "multilabel", "retrieval", "selection")}}
    plan = [("suite, features encoded", gpus, f"f{gpus}") for gpus in counts]
    plan += [("probe, features kept", gpus, f"f{gpus}") for gpus in (1, counts[-1])]
    runs = []
    for label, gpus, features in plan:
        run = evaluate if label.startswith("suite") else evaluate_probe
        row = run(gpus, ckpt, configs, workdir / features, workdir / f"{label[:5]}-{gpus}.json", args.timeout_s)
        row["run"] = label
        runs.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log_tail"})[:1500], flush=True)
        if "log_tail" in row:
            print(row["log_tail"][-2000:], flush=True)
        write_results(args.out, runs, **meta)
    suites = {r["gpus"]: r for r in runs if r["run"].startswith("suite") and "sets" in r}
    for gpus in counts[1:]:
        if 1 in suites and gpus in suites:
            runs.append({"run": "agreement", "gpus": [1, gpus], "max_abs_difference": agreement(suites[1],
                                                                                                 suites[gpus])})
            print(json.dumps(runs[-1]), flush=True)
    for kept in (r for r in runs if r["run"].startswith("probe") and "sets" in r):
        if kept["gpus"] in suites:  # the kept features give the cold run's probe
            kept["probe_difference_to_cold"] = agreement(kept, suites[kept["gpus"]])["digits_probe"]
    write_results(args.out, runs, **meta)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
