"""Train a CLIP model: `python train.py [group=option ...] [key=value ...]`.

Single process: `python train.py`. Several GPUs: `torchrun --nproc_per_node=8 train.py batch=1M`.
A sweep: `python train.py -m loss=vanilla optim.lr=1e-4,5e-4`. See README.md and configs/.
"""

import sys

from megabatch.runtime.process import configure_process

# before torch is imported: CUDA's queues for the decoding streams, the kept bytecode, the loader workers' fork server
# (importing beside this process; not where the fork server's preload imports this file)
configure_process(sys.argv[1:] if __name__ == "__main__" else None)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import megabatch.config  # noqa: E402,F401  (registers the configs' resolvers and schemas before Hydra composes)
from megabatch.config.cli import entry_args  # noqa: E402  shard patterns reach Hydra with their braces


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from megabatch.config import ConfigError
    from megabatch.config.cli import config_error_exit, job_exit
    from megabatch.train import PREEMPTED_EXIT, NonFiniteError, Preempted, RankLost, run

    # in a multirun (-m) a failed job is recorded (status.json, the sweep's summary) and the others run
    try:
        return run(cfg)  # the final zero-shot top-1: what a sweeper optimises
    except ConfigError as error:  # the key and the fix, one line, no traceback; status 2 (usage)
        raise job_exit(config_error_exit(error), f"config error: {error}") from None
    except RankLost as error:  # another rank died or failed: which one, status 1 (torchrun may restart)
        print(f"training stopped: {error}", file=sys.stderr)
        raise job_exit(SystemExit(1), f"training stopped: {error}") from None
    except NonFiniteError as error:  # diverged: what happened and what to change, status 1
        print(f"training stopped: {error}", file=sys.stderr)
        raise job_exit(SystemExit(1), f"training stopped: {error}") from None
    except Preempted as stopped:  # a signal or trainer.time_limit: checkpoint written, status 3
        print(f"training {stopped}", file=sys.stderr)
        raise SystemExit(PREEMPTED_EXIT) from None


if __name__ == "__main__":
    sys.argv[1:] = entry_args(sys.argv[1:])
    main()
