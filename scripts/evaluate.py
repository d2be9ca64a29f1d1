"""Zero-shot evaluation of a checkpoint.

    python scripts/evaluate.py ckpt=runs/<name>/checkpoints/last.pt            # embedded digits
    python scripts/evaluate.py ckpt=... eval=<set> eval.urls=... eval.batch_size=1024
"""

import json
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
    from megabatch.eval.checkpoint import evaluate_checkpoint

    try:
        result = evaluate_checkpoint(cfg)
    except ConfigError as error:  # the key and the fix, one line, no traceback; status 2 (usage)
        raise config_error_exit(error) from None
    output = Path(cfg.output or f"{Path(cfg.ckpt).with_suffix('')}.eval-{cfg.eval.name}.json")
    output.write_text(json.dumps(result, indent=1))
    if "top1" in result:
        print(f"{cfg.eval.name}: top-1 {result['top1']:.2f}%, top-5 {result['top5']:.2f}% "
              f"({result['samples']} images, step {result['step']}) -> {output}")
        return result["top1"]
    print(f"{cfg.eval.name}: {json.dumps(result)} -> {output}")
    return result["image_to_text_R@1"]


if __name__ == "__main__":
    sys.argv[1:] = entry_args(sys.argv[1:])
    main()
