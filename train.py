"""Train a CLIP model: `python train.py [group=option ...] [key=value ...]`.

Single process: `python train.py`. Several GPUs: `torchrun --nproc_per_node=8 train.py batch=1M`.
A sweep: `python train.py -m loss=vanilla optim.lr=1e-4,5e-4`. See README.md and configs/.
"""

import hydra
from omegaconf import DictConfig

import megabatch.config  # noqa: F401  (registers the configs' resolvers and schemas before Hydra composes)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from megabatch.config import ConfigError
    from megabatch.train import run

    try:
        return run(cfg)  # the final zero-shot top-1: what a sweeper optimises
    except ConfigError as error:  # the key and the fix, without a traceback
        raise SystemExit(f"config error: {error}") from None


if __name__ == "__main__":
    main()
