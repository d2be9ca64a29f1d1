"""Evaluation of a checkpoint, on one set or several, by one process or by every GPU of a machine.

    python scripts/evaluate.py ckpt=runs/<name>/checkpoints/last.pt            # embedded digits
    python scripts/evaluate.py ckpt=... eval=<set> eval.<set>.urls=... eval.<set>.batch_size=1024
    python scripts/evaluate.py ckpt=... 'eval=[imagenet,imagenet_v2]' eval.imagenet.root=... eval.imagenet_v2.root=...
    torchrun --nproc_per_node=4 scripts/evaluate.py ckpt=... eval=suite       # each GPU its share of each set

Beside the checkpoint: one ``<ckpt>.eval-<set>.json`` a set, and the checkpoint's table of every set's
metrics, ``<ckpt>.results.csv`` / ``.json`` (set, task, metric, value; the main metrics' average), the sets
evaluated earlier on the same checkpoint kept beside these. A linear
probe keeps the features it encodes in ``<ckpt>.features/`` (``features=<folder>``, or ``features=null`` for none).
"""

import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import megabatch.config  # noqa: F401  (registers the configs' resolvers and schemas)
from megabatch.config.cli import entry_args  # shard patterns reach Hydra with their braces


@hydra.main(config_path="../configs", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from megabatch.config import ConfigError
    from megabatch.config.cli import config_error_exit
    from megabatch.eval import headline, summary
    from megabatch.eval.evaluate import evaluate_checkpoint
    from megabatch.eval.results import results_table, write_results
    from megabatch.report.results import read_results

    try:
        results = evaluate_checkpoint(cfg)
    except ConfigError as error:  # the key and the fix, one line, no traceback; status 2 (usage)
        raise config_error_exit(error) from None
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 writes and prints
        return headline(next(iter(results.values())))
    stem = Path(cfg.ckpt).with_suffix("")
    if cfg.output:  # one file: the result, or {set: result} for several sets
        Path(cfg.output).write_text(json.dumps(next(iter(results.values())) if len(results) == 1 else results,
                                               indent=1))
    for name, result in results.items():
        output = Path(cfg.output or f"{stem}.eval-{name}.json")
        if not cfg.output:
            output.write_text(json.dumps(result, indent=1))
        print(f"{summary(name, result)}, step {result['step']}, {result['seconds']:.1f} s -> {output}", flush=True)
    # one table per checkpoint: every set's metrics (set, task, metric, value), and the main metrics' average
    csv_path, json_path = write_results(stem, results, step=next(iter(results.values()))["step"])
    print(f"{results_table(read_results(json_path))}\n-> {csv_path} (and .json)", flush=True)
    return headline(next(iter(results.values())))


if __name__ == "__main__":
    from megabatch.runtime.signals import kill_workers_at_exit

    kill_workers_at_exit()  # a failed evaluation's loader workers (they ignore SIGTERM) never hold its exit
    sys.argv[1:] = entry_args(sys.argv[1:])
    main()
